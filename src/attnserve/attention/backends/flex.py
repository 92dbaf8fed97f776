"""flex_attention: PyTorch FlexAttention reading the paged pool in place.

The key axis is the pool itself (every slot, `[1, kv_heads, num_slots, d]` as a
strided view, no copy) and the query axis is the step's new tokens. What a query
may see is a mask over slots: the slot appears in the query's own request's
position -> slot row (req_to_token) at a visible position (causal, sliding
window, or the verify tree's custom mask). Requests may share slots (the radix
cache hands one prefix's pages to every request that starts with it), so a slot
has no single owner; it does have a single position, because its keys were
rotated for that position, and two requests share a slot only at the same
position. plan() builds slot -> position, the batch's rows, and a block-sparse
BlockMask whose blocks are exactly the KV blocks each query block's requests
use, so the fused kernel skips the rest of the pool.

On CUDA the compiled kernel runs; on the CPU FlexAttention's eager path does the
same maths densely (fine for tests, not for speed). Captured graphs are not
supported: the block mask changes size every step.

No deterministic mode: a query's sums run over the pool's slots in slot order,
and which slots hold a request's keys depends on the requests that came before
it (the eager path also multiplies every query of the step at once, whose kernel
depends on the step's token count), so a request's output rounds differently with
the batch. `--enable-deterministic-inference` refuses this backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnserve.attention.base import (
    EVERY_LAYER_VARIANT,
    EVERY_VERIFY_SHAPE,
    AttentionBackend,
    BackendFeatures,
)
from attnserve.batch import ForwardBatch

Q_BLOCK = 128
KV_BLOCK = 128


@dataclass
class FlexStep:
    """What plan() built for one step: the lookups the mask reads and the block table it is sparse over."""

    req_slots: torch.Tensor  # [B, max(max_len, 1)] int64: each request's position -> slot, -1 past its length
    kv_pos: torch.Tensor  # [num_slots] int64: slot -> position
    q_req: torch.Tensor  # [T] int64: each new token's request
    q_pos: torch.Tensor  # [T] int64: each new token's position
    custom: torch.Tensor | None  # [T, max_len] bool verify masks, or None
    blocks: tuple[torch.Tensor, torch.Tensor]  # (kv_num_blocks [1, 1, nqb], kv_indices [1, 1, nqb, nkvb])
    num_tokens: int
    masks: dict = field(default_factory=dict)  # sliding window -> BlockMask, built at its first layer


class FlexAttentionBackend(AttentionBackend):
    name = "flex_attention"
    features = BackendFeatures(
        kv_dtypes=frozenset({"bf16", "fp16", "fp32"}),
        attention_types=frozenset({"MHA", "GQA"}),
        asymmetric_kv=True,
        **EVERY_LAYER_VARIANT,
        **EVERY_VERIFY_SHAPE,
        cuda_graph=False,
        deterministic=False,  # see the module's docstring
        devices=frozenset({"cpu", "cuda"}),
    )

    def __init__(self, pool, compile: bool | None = None, **options):
        """compile: use torch.compile'd flex_attention (default: on CUDA only)."""
        super().__init__(pool, **options)
        if getattr(pool, "is_mla", False):
            raise ValueError("flex_attention serves MHA/GQA pools; use triton or torch_native for MLA")
        self.compile = pool.device.type == "cuda" if compile is None else compile
        self._flex = None

    # ---- per step -----------------------------------------------------------------------------
    def plan(self, fb: ForwardBatch) -> FlexStep:
        device = fb.req_to_token.device
        bs = fb.batch_size
        num_slots = self.pool.num_slots
        max_len = max(fb.seq_lens_cpu, default=0)
        seq_lens = fb.seq_lens.to(device=device, dtype=torch.int64)  # [B]
        extend_lens = fb.extend_lens.to(device=device, dtype=torch.int64)  # [B]
        positions = torch.arange(max_len, device=device)  # [max_len]
        rows = fb.req_to_token[fb.req_pool_indices.long(), :max_len].long()  # [B, max_len]
        valid = positions[None, :] < seq_lens[:, None]  # [B, max_len]
        slots = rows[valid]  # [total_kv], a shared slot once per request using it
        owners = torch.arange(bs, device=device)[:, None].expand(bs, max_len)[valid]  # [total_kv]
        slot_positions = positions[None, :].expand(bs, max_len)[valid]  # [total_kv]
        # each request's position -> slot row, -1 past its length (stale entries must not match)
        req_slots = torch.full((bs, max(max_len, 1)), -1, dtype=torch.int64, device=device)  # [B, max(max_len, 1)]
        req_slots[:, :max_len] = torch.where(valid, rows, -1)
        # slot -> position, the same in every request that uses the slot
        kv_pos = torch.zeros(num_slots, dtype=torch.int64, device=device)  # [num_slots]
        kv_pos[slots] = slot_positions
        self._check_one_position_per_slot(kv_pos, slots, slot_positions)
        num_tokens = fb.num_tokens
        q_req = torch.repeat_interleave(torch.arange(bs, device=device), extend_lens, output_size=num_tokens)  # [T]
        q_pos = fb.positions.to(device=device, dtype=torch.int64)  # [T]
        custom = self._dense_custom_mask(fb, max_len) if fb.custom_mask is not None else None
        blocks = self._block_table(q_req, owners, slots, bs, num_tokens, num_slots)
        return FlexStep(req_slots, kv_pos, q_req, q_pos, custom, blocks, num_tokens)

    @staticmethod
    def _check_one_position_per_slot(kv_pos, slots, slot_positions) -> None:
        """A slot used at two positions would make the mask ambiguous; refuse it.

        On the CPU this raises at once; on CUDA it is an asynchronous device assert, so
        plan() stays free of host syncs.
        """
        consistent = (kv_pos[slots] == slot_positions).all()  # [] bool
        if slots.device.type == "cpu":
            if not bool(consistent):
                raise ValueError("a KV slot appears at different positions in this batch's requests; "
                                 "shared slots must sit at the same position in every request")
        else:
            torch._assert_async(consistent)

    @staticmethod
    def _dense_custom_mask(fb: ForwardBatch, max_len: int) -> torch.Tensor:
        """The verify masks as one `[T, max_len]` bool table indexed by (token, key position)."""
        dense = torch.zeros(fb.num_tokens, max(max_len, 1), dtype=torch.bool, device=fb.custom_mask.device)
        q0 = m0 = 0
        for seq, ext in zip(fb.seq_lens_cpu, fb.extend_lens_cpu):
            dense[q0 : q0 + ext, :seq] = fb.custom_mask[m0 : m0 + ext * seq].view(ext, seq).to(torch.bool)
            q0 += ext
            m0 += ext * seq
        return dense

    @staticmethod
    def _block_table(q_req, owners, slots, bs, num_tokens, num_slots) -> tuple[torch.Tensor, torch.Tensor]:
        """Which KV blocks each query block may touch: those holding its requests' slots."""
        device = slots.device
        nqb = max(1, -(-num_tokens // Q_BLOCK))
        nkvb = max(1, -(-num_slots // KV_BLOCK))
        req_qblocks = torch.zeros(bs, nqb, dtype=torch.float32, device=device)  # [B, nqb]
        req_qblocks[q_req, torch.arange(num_tokens, device=device) // Q_BLOCK] = 1.0
        req_kvblocks = torch.zeros(bs, nkvb, dtype=torch.float32, device=device)  # [B, nkvb]
        req_kvblocks[owners, slots // KV_BLOCK] = 1.0
        touches = (req_qblocks.T @ req_kvblocks) > 0  # [nqb, nkvb]
        kv_num_blocks = touches.sum(-1).to(torch.int32)  # [nqb]
        kv_indices = torch.argsort((~touches).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # [nqb, nkvb]
        return kv_num_blocks[None, None], kv_indices[None, None]

    def _block_mask(self, step: FlexStep, sliding_window: int | None):
        if sliding_window in step.masks:
            return step.masks[sliding_window]
        from torch.nn.attention.flex_attention import BlockMask

        req_slots, kpos, qreq, qpos, custom = step.req_slots, step.kv_pos, step.q_req, step.q_pos, step.custom

        def visible(b, h, q_idx, kv_idx):
            p, k = qpos[q_idx], kpos[kv_idx]
            # the slot is the query's own request's token at position k
            same = req_slots[qreq[q_idx], k] == kv_idx
            seen = custom[q_idx, k] if custom is not None else k <= p
            if sliding_window is not None:
                seen = seen & (k > p - sliding_window)
            return same & seen

        kv_num_blocks, kv_indices = step.blocks
        mask = BlockMask.from_kv_blocks(
            kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=visible,
            seq_lengths=(step.num_tokens, self.pool.num_slots),
        )
        step.masks[sliding_window] = mask
        return mask

    # ---- forward ---------------------------------------------------------------------------------
    def _flex_fn(self):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = torch.compile(flex_attention) if self.compile else flex_attention
        return self._flex

    def _attend(self, q: torch.Tensor, layer, step: FlexStep) -> torch.Tensor:
        lid = layer.layer_id
        k_buf = self.pool.get_key_buffer(lid)  # [num_slots, Hkv, D]
        v_buf = self.pool.get_value_buffer(lid)  # [num_slots, Hkv, Dv]
        dtype = q.dtype
        key = k_buf.to(dtype).permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, num_slots, D]
        value = v_buf.to(dtype).permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, num_slots, Dv]
        query = q.permute(1, 0, 2).unsqueeze(0)  # [1, Hq, T, D]
        score_mod = None
        if layer.logit_cap is not None:
            cap = float(layer.logit_cap)

            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

        sinks = layer.sinks
        out = self._flex_fn()(
            query, key, value, score_mod=score_mod, block_mask=self._block_mask(step, layer.sliding_window),
            scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads, return_lse=sinks is not None,
        )
        if sinks is not None:
            out, lse = out  # lse [1, Hq, T], natural log of the scaled scores' exp-sum
            # a sink joins the denominator: o * sum / (sum + exp(sink)) = o * sigmoid(lse - sink)
            out = out * torch.sigmoid(lse.float() - sinks.float()[None, :, None]).to(out.dtype)[..., None]
        return out[0].permute(1, 0, 2)  # [T, Hq, Dv]

    def forward_extend(self, q, k, v, layer, fb, meta: FlexStep):
        return self._attend(q, layer, meta)

    def forward_decode(self, q, layer, fb, meta: FlexStep):
        return self._attend(q, layer, meta)
