"""torch_native: attention over the paged pool in plain PyTorch; the CPU default.

Decode runs torch's fused SDPA over the running batch's K/V kept contiguous between steps
(contiguous_decode_kv: one row appended per request per step, a gather only when the batch changes),
with the GQA group as the query length, so a layer costs a few kernel launches whatever the
batch. Layers with a soft-cap, sinks or a sliding window, and scaled (FP8) or MLA pools, take the
general path: one gather of every request's KV into a padded `[B, max_len, kv_heads, d]` tensor
and two batched matmuls. Extend loops over requests
(never tokens) and uses SDPA's fused kernel unless a feature it lacks (soft-cap,
sinks, custom mask) is on. Everything a layer needs that does not depend on
the layer (slots, masks) is built once in plan().
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnserve.attention.backends.contiguous_decode_kv import (
    ContiguousDecodeKV,
    DecodeStep,
    layer_kv,
    plan_decode_step,
)
from attnserve.attention.base import (
    ALL_KV_DTYPES,
    EVERY_LAYER_VARIANT,
    EVERY_VERIFY_SHAPE,
    AttentionBackend,
    BackendFeatures,
)
from attnserve.batch import ForwardBatch


@dataclass
class _ExtendRequest:
    q_start: int
    q_end: int
    slots: torch.Tensor  # [seq_len] int64
    mask: torch.Tensor | None  # [ext, seq_len] bool, None = plain causal over a fresh prompt


@dataclass
class _DecodePlan:
    slots: torch.Tensor  # [B, max_len] int64 (padding points at slot 0)
    positions: torch.Tensor  # [max_len] int64
    seq_lens: torch.Tensor  # [B] int64

    @classmethod
    def of(cls, fb: ForwardBatch) -> _DecodePlan:
        max_len = max(fb.seq_lens_cpu, default=0)
        rows = fb.req_to_token[fb.req_pool_indices.long(), :max_len].long()  # [B, max_len]
        positions = torch.arange(max_len, device=rows.device)
        seq_lens = fb.seq_lens.to(rows.device, torch.int64)
        return cls(rows.masked_fill(positions[None, :] >= seq_lens[:, None], 0), positions, seq_lens)


@dataclass
class TorchNativeStep:
    """What plan() built for one step."""

    fb: ForwardBatch
    mirrored: DecodeStep | None = None  # a decode step's share of the kept K/V (the fused SDPA path)
    extend: list[_ExtendRequest] = field(default_factory=list)  # an extend step's requests
    _padded: _DecodePlan | None = None

    @property
    def padded_decode(self) -> _DecodePlan:
        """The general decode path's padded slots, built at the first layer that takes that path."""
        if self._padded is None:
            self._padded = _DecodePlan.of(self.fb)
        return self._padded


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if x.dtype in (torch.float32, torch.float64) or x.device.type == "cuda":
        return x.dtype
    return torch.float32  # CPU matmuls in half precision are slow and less accurate


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    features = BackendFeatures(
        kv_dtypes=ALL_KV_DTYPES,
        attention_types=frozenset({"MHA", "GQA", "MLA"}),
        asymmetric_kv=True,
        **EVERY_LAYER_VARIANT,
        **EVERY_VERIFY_SHAPE,
        cuda_graph=False,
        deterministic=True,
        devices=frozenset({"cpu", "cuda", "mps"}),
    )

    _mirror: ContiguousDecodeKV | None = None  # the decode batch's K/V copies, kept from step to step

    def plan(self, fb: ForwardBatch) -> TorchNativeStep:
        step = TorchNativeStep(fb)
        if fb.mode.is_decode:
            if self._mirror_ok():
                pool = self.pool
                row_bytes = (pool.get_key_buffer(0)[0].numel() + pool.get_value_buffer(0)[0].numel()) \
                    * pool.get_key_buffer(0).element_size()
                step.mirrored = plan_decode_step(self._mirror, fb, row_bytes, pool.num_layers)
                self._mirror = step.mirrored.mirror
            return step
        self._mirror = None  # a prefill chunk may bring new requests into rows: rebuild at the next decode
        q_start = 0
        mask_start = 0
        rows = fb.req_pool_indices.tolist()
        for row, seq, ext in zip(rows, fb.seq_lens_cpu, fb.extend_lens_cpu):
            slots = fb.req_to_token[row, :seq].long()
            mask = None
            if fb.custom_mask is not None:
                mask = fb.custom_mask[mask_start : mask_start + ext * seq].view(ext, seq).to(torch.bool)
                mask_start += ext * seq
            step.extend.append(_ExtendRequest(q_start, q_start + ext, slots, mask))
            q_start += ext
        return step

    def _mirror_ok(self) -> bool:
        pool = self.pool
        return not pool.is_mla and not pool.is_fp8 and pool.num_layers > 0

    def forward(self, q, k, v, layer, fb, meta: TorchNativeStep):
        step = meta.mirrored
        if (step is not None and fb.mode.is_decode and q.shape[0] and k is not None and v is not None
                and layer.logit_cap is None and layer.sinks is None and layer.sliding_window is None
                and q.dtype == self.pool.dtype):
            return self._forward_decode_sdpa(q, k, v, layer, step)
        return super().forward(q, k, v, layer, fb, meta)

    def _forward_decode_sdpa(self, q, k, v, layer, step: DecodeStep) -> torch.Tensor:
        """Fused SDPA over the kept K/V; the GQA group rides as the query length: q `[B, Hkv, G, D]`."""
        bs = q.shape[0]
        keys, values = layer_kv(step, self.pool, layer.layer_id, k.view(bs, layer.num_kv_heads, -1),
                                v.view(bs, layer.num_kv_heads, -1))  # [B, Hkv, L, D], [B, Hkv, L, Dv]
        qg = q.reshape(bs, layer.num_kv_heads, layer.gqa_group, layer.head_dim)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=step.mask, scale=layer.scaling)
        return out.reshape(bs, layer.num_heads, layer.v_head_dim)  # [B, Hq, Dv]

    # ---- shared math -------------------------------------------------------------------
    def _kv(self, layer, slots: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather and dequantise K/V rows of the given slots (any index shape)."""
        pool, lid = self.pool, layer.layer_id
        k = pool.dequantize(pool.get_key_buffer(lid)[slots], pool.k_scale[lid], dtype)
        v = pool.dequantize(pool.get_value_buffer(lid)[slots], pool.v_scale[lid], dtype)
        return k, v

    @staticmethod
    def _softmax_attend(scores, v, layer, sinks_shape):
        """scores `[..., Hkv, G, M, L]` (masked with -inf) -> probabilities @ v, sinks and soft-cap applied."""
        m = scores.amax(-1, keepdim=True)
        if layer.sinks is not None:
            sinks = layer.sinks.to(scores.dtype).view(sinks_shape)
            m = torch.maximum(m, sinks)
        m = torch.nan_to_num(m, neginf=0.0)
        p = torch.exp(scores - m)
        denom = p.sum(-1, keepdim=True)
        if layer.sinks is not None:
            denom = denom + torch.exp(sinks - m)
        return torch.matmul(p, v) / denom.clamp_min(torch.finfo(p.dtype).tiny)

    # ---- decode ------------------------------------------------------------------------
    def forward_decode(self, q, layer, fb, meta: TorchNativeStep):
        plan = meta.padded_decode
        cdt = _compute_dtype(q)
        bs, hq, _ = q.shape
        hkv, group = layer.num_kv_heads, layer.gqa_group
        k, v = self._kv(layer, plan.slots, cdt)  # [B, L, Hkv, D], [B, L, Hkv, Dv]
        qg = q.to(cdt).view(bs, hkv, group, 1, layer.head_dim)  # [B, Hkv, G, 1, D]
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1).unsqueeze(2)) * layer.scaling  # [B, Hkv, G, 1, L]
        if layer.logit_cap is not None:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        visible = plan.positions[None, :] < plan.seq_lens[:, None]  # [B, L]
        if layer.sliding_window is not None:
            visible &= plan.positions[None, :] > (plan.seq_lens[:, None] - 1 - layer.sliding_window)
        scores = scores.masked_fill(~visible[:, None, None, None, :], -math.inf)
        out = self._softmax_attend(scores, v.permute(0, 2, 1, 3).unsqueeze(2), layer, (1, hkv, group, 1, 1))
        return out.reshape(bs, hq, layer.v_head_dim).to(q.dtype)

    # ---- extend ------------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, fb, meta: TorchNativeStep):
        cdt = _compute_dtype(q)
        out = torch.empty(q.shape[0], q.shape[1], layer.v_head_dim, dtype=q.dtype, device=q.device)
        fused_ok = layer.logit_cap is None and layer.sinks is None
        for req in meta.extend:
            ext = req.q_end - req.q_start
            seq = req.slots.numel()
            kr, vr = self._kv(layer, req.slots, cdt)  # [L, Hkv, D], [L, Hkv, Dv]
            qr = q[req.q_start : req.q_end].to(cdt)  # [M, Hq, D]
            q_pos = torch.arange(seq - ext, seq, device=q.device)
            k_pos = torch.arange(seq, device=q.device)
            if req.mask is not None:
                visible = req.mask.clone()
            else:
                visible = k_pos[None, :] <= q_pos[:, None]  # [M, L]
            if layer.sliding_window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - layer.sliding_window
            if fused_ok and req.mask is None:
                o = F.scaled_dot_product_attention(
                    qr.transpose(0, 1)[None],
                    kr.transpose(0, 1)[None],
                    vr.transpose(0, 1)[None],
                    attn_mask=None if (ext == seq and layer.sliding_window is None) else visible,
                    is_causal=ext == seq and layer.sliding_window is None,
                    scale=layer.scaling,
                    enable_gqa=layer.gqa_group > 1,
                )  # [1, Hq, M, Dv]
                out[req.q_start : req.q_end] = o[0].transpose(0, 1).to(q.dtype)
                continue
            hkv, group = layer.num_kv_heads, layer.gqa_group
            qg = qr.view(ext, hkv, group, layer.head_dim).permute(1, 2, 0, 3)  # [Hkv, G, M, D]
            scores = torch.matmul(qg, kr.permute(1, 2, 0).unsqueeze(1)) * layer.scaling  # [Hkv, G, M, L]
            if layer.logit_cap is not None:
                scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
            scores = scores.masked_fill(~visible, -math.inf)
            o = self._softmax_attend(scores, vr.permute(1, 0, 2).unsqueeze(1), layer, (hkv, group, 1, 1))
            out[req.q_start : req.q_end] = o.permute(2, 0, 1, 3).reshape(ext, -1, layer.v_head_dim).to(q.dtype)
        return out
