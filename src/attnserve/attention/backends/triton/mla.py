"""TritonMLABackend: attnserve's absorbed-MLA kernels over the latent pool (DeepSeek).

Decode runs the layer's KernelPlan (kernels/plan.py): on Hopper a Gluon kernel the decode table names for the
head count and page size, elsewhere (or for what the Gluon kernels lack, e.g. an FP8 latent) the Triton kernel
(kernels/mla/decode.py). Extend runs as decode rows (kernels/mla/extend_rows.py) wherever the Gluon kernel runs,
else on the absorbed extend kernel (kernels/mla/extend.py). Fresh prompts may run expanded instead
(`forward_expanded_prefill`): per-head keys and values through the MHA extend kernel, fewer FLOPs than the
576/512-wide latent space.

The pool does not know the query heads, so the decode plan is resolved at the first MLA layer of a signature;
a step planned before it is re-planned once with the plan's head groups and split waves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from attnserve.attention.backends.triton.common import FEATURES, DecodeStep, TritonBackendBase
from attnserve.attention.kernels.gpu_target import target_for
from attnserve.attention.kernels.plan import KernelPlan, LayerSignature
from attnserve.attention.kernels.resolve import plan_mla_decode, plan_mla_extend_rows
from attnserve.batch import ForwardBatch

if TYPE_CHECKING:
    from attnserve.attention.backends.triton.common import ExtendStep, TritonStep
    from attnserve.attention.layer import AttentionLayer
    from attnserve.kvcache.pool import KVPool


class TritonMLABackend(TritonBackendBase):
    OPTIONS = frozenset({"mla_decode_config", "mla_extend_config", "mla_extend_rows", "decode_config",
                         "extend_config", "prefill_tma", "prefill_tma_config", "prefill_tma_gather_mib"})
    # fresh prompts may run expanded (forward_expanded_prefill); AttentionLayer and the hybrid route to it
    features = replace(FEATURES, expanded_mla_prefill=True)

    def __init__(self, pool: KVPool, **options):
        """Options: num_sms, split_waves, min_split_tokens, max_kv_splits (the decode split policy),
        mla_decode_config (kernels.mla.decode_table.MLADecodeConfig), mla_extend_config
        (kernels.mla.extend.MLAExtendConfig), mla_extend_rows (absorbed MLA extend through the decode kernel, a
        decode row per new token: None, the default, wherever the Gluon kernel runs and no mla_extend_config is
        given; False: never; True: always, on the decode tile where Gluon cannot run; custom masks then raise).
        The MHA options (decode_config, extend_config, prefill_tma*) are accepted and unused."""
        super().__init__(pool, **options)
        if not pool.is_mla:
            raise ValueError("TritonMLABackend serves MLA pools; an MHA / GQA pool takes TritonMHABackend")
        rank = pool.kv_lora_rank
        if rank < 16 or rank & (rank - 1):
            raise ValueError(f"kv_lora_rank {rank} unsupported by the triton MLA kernels (a power of two >= 16)")
        self.mla_decode_config = options.get("mla_decode_config")
        self.mla_extend_config = options.get("mla_extend_config")
        self.mla_extend_rows = options.get("mla_extend_rows")
        # programs per (request, split): head groups of the current decode plan (1 until the first layer's)
        self._head_groups = 1
        self._rows_plans: dict = {}  # (heads, q dtype) -> (extend rows' KernelPlan, tokens a CTA, None) or why not

    def _programs_per_split(self) -> int:
        return self._head_groups

    def _graph_programs(self) -> int:
        return 1  # the head groups may be resolved after a capture: size for one program per split

    def _signature(self, num_heads: int, q_dtype: torch.dtype) -> LayerSignature:
        pool = self.pool
        return LayerSignature.of_gpu(target_for(pool.device), family="mla", num_heads=num_heads, num_kv_heads=1,
                                     head_dim=pool.head_dim, v_head_dim=pool.kv_lora_rank,
                                     page_size=pool.page_size, q_dtype=q_dtype, kv_dtype=pool.dtype,
                                     kv_lora_rank=pool.kv_lora_rank)

    def decode_plan(self, num_heads: int, q_dtype: torch.dtype) -> KernelPlan:
        """The decode kernel plan of this head count and query dtype, resolved at its first layer."""
        key = (num_heads, q_dtype)
        plan = self._kernel_plans.get(key)
        if plan is None:
            plan = self._kernel_plans[key] = plan_mla_decode(self._signature(num_heads, q_dtype), self._base_policy,
                                                             self.mla_decode_config, self._split_waves_given)
        return plan

    def rows_plan(self, num_heads: int, q_dtype: torch.dtype) -> tuple[KernelPlan | None, int, str | None]:
        """(the extend rows' KernelPlan, tokens a CTA, None), or (None, 1, why not) for this signature."""
        key = (num_heads, q_dtype)
        if key not in self._rows_plans:
            self._rows_plans[key] = plan_mla_extend_rows(
                self._signature(num_heads, q_dtype), self._base_policy, self.decode_plan(num_heads, q_dtype),
                self.mla_extend_rows, self.mla_extend_config is not None, self._split_waves_given)
        return self._rows_plans[key]

    def kernel_plans(self) -> list[KernelPlan]:
        return [*self._kernel_plans.values(), *(p for p, _, _ in self._rows_plans.values() if p is not None)]

    # ---- KV store --------------------------------------------------------------------------------
    def store_kv(self, layer: AttentionLayer, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor | None) -> None:
        from attnserve.attention.kernels.store import store_kv

        lid = layer.layer_id  # one latent row per token; V is a view of it
        store_kv(self.pool.get_key_buffer(lid), None, fb.out_cache_loc, k, None, self.pool.k_scale[lid])

    # ---- extend ----------------------------------------------------------------------------------
    def _extend_layer(self, q, k, v, out, layer: AttentionLayer, step: ExtendStep) -> torch.Tensor:
        from attnserve.attention.kernels.mla.extend import default_mla_extend_config, mla_extend_attention
        from attnserve.attention.kernels.mla.extend_rows import mla_extend_rows_attention

        lid = layer.layer_id
        rows, plan, blocker = self._mla_extend_rows(step, q, layer)
        if rows is not None:
            tokens = rows.token_groups[2] if rows.token_groups else 1
            step.path = f"mla decode rows ({plan.kernel}, {tokens} token{'s' * (tokens > 1)} a CTA)"
            q = self._gluon_layout(q, plan)
            return mla_extend_rows_attention(q, self.pool.get_key_buffer(lid), out, rows, step.meta.kv_indices,
                                             layer.scaling, plan, self.pool.k_scale[lid])
        step.path = f"mla tiles ({blocker})"
        cfg = self.mla_extend_config or default_mla_extend_config(self.pool.device)
        rows = self._extend_rows(step, self._tiles_of(step, cfg.positions_per_tile(layer.gqa_group)))
        return mla_extend_attention(q, self.pool.get_key_buffer(lid), out, rows, layer.scaling, self.pool.kv_lora_rank,
                                    self.pool.k_scale[lid], config=self.mla_extend_config)

    def _mla_extend_rows(self, step: ExtendStep, q: torch.Tensor, layer: AttentionLayer):
        """(the step's decode-row plan, its KernelPlan, None) when this MLA extend runs as decode rows, else
        (None, None, why not). Decided at the step's first MLA layer; the signature's plan once per backend."""
        from attnserve.attention.kernels.mla import extend_rows

        if step.mla_rows is not None:
            return step.mla_rows
        plan, tokens, blocker = self.rows_plan(layer.num_heads, q.dtype)
        if self.mla_extend_rows is not False and step.custom_mask is not None:
            blocker = "custom mask"
        elif self.mla_extend_rows is not False and q.shape[0] > extend_rows.MAX_ROWS:
            blocker = f"{q.shape[0]} new tokens exceed the grid's {extend_rows.MAX_ROWS} rows"
        if blocker is not None:
            if self.mla_extend_rows:
                raise ValueError(f"MLA extend as decode rows does not apply to this call: {blocker}")
            step.mla_rows = (None, None, blocker)
            return step.mla_rows
        rows = extend_rows.plan_extend_rows(step.prefix_lens, step.extend_lens, self.pool.page_size, self.pool.device,
                                plan.programs_per_split, plan.split_policy, tokens)
        step.mla_rows = (rows, plan, None)
        return step.mla_rows

    def expanded_prefill_applies(self, fb: ForwardBatch, meta: TritonStep) -> bool:
        """Whether this step may run expanded MLA: fresh prompts only (no cached prefix, no custom mask, no verify)."""
        step = meta.extend
        return step is not None and not step.verify and step.custom_mask is None and not any(step.prefix_lens)

    def forward_expanded_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                                 fb: ForwardBatch, meta: TritonStep) -> torch.Tensor:
        """Fresh prompts of an MLA model over their latent expanded per head: fewer FLOPs than absorbed.

        q, k `[T, H, nope + rope]`, v `[T, H, v_head_dim]` (narrower than k) -> `[T, H, v_head_dim]`. The latent
        rows still go to the pool (store_kv) for the decode steps that follow.
        """
        from attnserve.attention.kernels.mha.extend import expanded_prefill_attention, plan_expanded_prefill

        if not self.expanded_prefill_applies(fb, meta):
            raise ValueError("expanded MLA runs fresh prompts of an MLA model only (no cached prefix, no custom mask)")
        step = meta.extend
        if step.expanded is None:
            step.expanded = plan_expanded_prefill(step.extend_lens, q.shape[-1], self.pool.device)
        return expanded_prefill_attention(q, k, v, step.expanded, layer.scaling)

    # ---- decode ----------------------------------------------------------------------------------
    @staticmethod
    def _gluon_layout(q: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        """The Gluon kernels copy 16-byte vectors: a query whose row strides are not multiples of 8 is copied."""
        if plan.is_gluon and (q.stride(0) % 8 or q.stride(1) % 8):
            return q.contiguous()
        return q

    def _use_plan(self, meta: TritonStep, plan: KernelPlan) -> DecodeStep:
        """The step's splits as the plan counts them: an eager step planned before the plan is re-planned once
        (the step's metadata then holds the new split plan for its later layers).

        A graph step keeps its splits (any count up to the captured grid is correct); later steps use the plan.
        """
        step = meta.decode
        if plan.programs_per_split == self._head_groups and plan.split_policy == self.split_policy:
            return step
        self._head_groups = plan.programs_per_split
        self.split_policy = plan.split_policy
        if step.graph_bs or step.seq_lens_cpu is None:
            return step
        meta.decode = self._plan_decode(step.seq_lens_cpu, step.meta, step.seq_lens)
        return meta.decode

    def _decode_layer(self, q: torch.Tensor, out: torch.Tensor, layer: AttentionLayer, meta: TritonStep) -> torch.Tensor:
        from attnserve.attention.kernels.mla.attention import mla_decode_attention

        plan = self.decode_plan(layer.num_heads, q.dtype)
        step = self._use_plan(meta, plan)
        lid = layer.layer_id
        return mla_decode_attention(self._gluon_layout(q, plan), self.pool.get_key_buffer(lid), out, step.rows, plan,
                                    layer.scaling, self.pool.k_scale[lid], partials=self._partials_for(step, layer),
                                    write_final=step.write_final)


__all__ = ["TritonMLABackend"]
