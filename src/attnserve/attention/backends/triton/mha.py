"""TritonMHABackend: attnserve's Triton kernels for MHA / GQA pools.

Decode is Flash-Decoding with each KV head's query group on tensor cores (kernels/mha/decode.py). Extend /
prefill takes, per call, one of two kernels: on Hopper the TMA kernel (kernels/mha/prefill_tma.py: keys as
contiguous rows through tensor descriptors, warp-specialised: the call's own k/v for fresh prompts, each
request's keys gathered from the pool when there is a cached prefix; or its Gluon twin, kernels/mha/prefill_gluon.py,
which reads a cached prefix's keys where they lie in the pool), and everywhere else, or for what it
lacks (custom masks, FP8 pools, head dims other than 64/128/256, a V width unlike K's), the FlashAttention-2
style kernel that reads the prefix and the new tokens through the page table (kernels/mha/extend.py).
The step metadata's `extend_path` names the one that ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnserve.attention.backends.triton.common import TritonBackendBase
from attnserve.attention.kernels.gpu_target import target_for
from attnserve.attention.kernels.plan import KernelPlan, LayerSignature
from attnserve.attention.kernels.resolve import plan_mha_decode
from attnserve.batch import ForwardBatch

if TYPE_CHECKING:
    from attnserve.attention.backends.triton.common import ExtendStep, TritonStep
    from attnserve.attention.layer import AttentionLayer
    from attnserve.kvcache.pool import KVPool


class TritonMHABackend(TritonBackendBase):
    SPLIT_MIXED = True
    OPTIONS = frozenset({"decode_config", "extend_config", "prefill_tma", "prefill_tma_config", "prefill_kernel",
                         "prefill_tma_gather_mib", "mla_decode_config", "mla_extend_config", "mla_extend_rows"})

    def __init__(self, pool: KVPool, **options):
        """Options: num_sms, split_waves, min_split_tokens, max_kv_splits (the decode split policy),
        decode_config (kernels.mha.configs.DecodeConfig), extend_config (kernels.mha.extend.ExtendConfig),
        prefill_tma (None: wherever it applies, the default; False: never; True: raise where it does not apply),
        prefill_tma_config (kernels.mha.prefill_tma.PrefillTmaConfig), prefill_kernel (on the TMA path: "auto", the
        default, runs kernels.mha.prefill_gluon where it serves the call, causal at head_dim 128 on sm90, and its
        query tiles read prefill_gluon.MIN_MEAN_KEY_TILES key tiles or more on average; "gluon" wherever it serves
        the call; "triton": prefill_tma always), prefill_tma_gather_mib (the most memory
        prefill_tma may gather a batch's cached keys into, default 1024 MiB; beyond it the paged kernel runs; the
        Gluon kernel gathers nothing),
        split_mixed (default True: a MIXED step's leading decodes run through the decode kernel, the prompt chunks
        alone through the extend path). The MLA options are accepted and unused, as one option set serves both
        pools."""
        super().__init__(pool, **options)
        if pool.is_mla:
            raise ValueError("TritonMHABackend serves MHA / GQA pools; an MLA pool takes TritonMLABackend")
        if max(pool.head_dim, pool.v_head_dim) > 256:
            raise ValueError(f"head_dim {max(pool.head_dim, pool.v_head_dim)} unsupported by the triton backend "
                             "(at most 256)")
        self.decode_config = options.get("decode_config")
        self.extend_config = options.get("extend_config")
        self.prefill_tma = options.get("prefill_tma")
        self.prefill_tma_config = options.get("prefill_tma_config")
        self.prefill_kernel = options.get("prefill_kernel") or "auto"
        if self.prefill_kernel not in ("auto", "triton", "gluon"):
            raise ValueError(f"prefill_kernel must be 'auto', 'triton' or 'gluon', not {self.prefill_kernel!r}")
        self.prefill_tma_gather_bytes = int(options.get("prefill_tma_gather_mib", 1024)) << 20

    def _programs_per_split(self) -> int:
        return self.pool.num_kv_heads

    def _graph_programs(self) -> int:
        return self.pool.num_kv_heads

    def decode_plan(self, layer: AttentionLayer, q_dtype: torch.dtype) -> KernelPlan:
        """The decode kernel plan of this layer's signature, resolved at its first layer."""
        key = (layer.num_heads, layer.head_dim, layer.v_head_dim, q_dtype)
        plan = self._kernel_plans.get(key)
        if plan is None:
            pool = self.pool
            sig = LayerSignature.of_gpu(target_for(pool.device), family="mha", num_heads=layer.num_heads,
                                        num_kv_heads=pool.num_kv_heads, head_dim=layer.head_dim,
                                        v_head_dim=layer.v_head_dim, page_size=pool.page_size, q_dtype=q_dtype,
                                        kv_dtype=pool.dtype)
            plan = self._kernel_plans[key] = plan_mha_decode(sig, self.split_policy, self.decode_config)
        return plan

    # ---- KV store --------------------------------------------------------------------------------
    def store_kv(self, layer: AttentionLayer, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor | None) -> None:
        from attnserve.attention.kernels.store import store_kv

        lid = layer.layer_id
        store_kv(self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid), fb.out_cache_loc, k, v,
                 self.pool.k_scale[lid], self.pool.v_scale[lid])

    # ---- extend ----------------------------------------------------------------------------------
    def _extend_config(self, step: ExtendStep, group: int):
        """The paged extend kernel's tiles: extend_config when given, else a verify step's GQA-packed ones (the
        same graphed and eager, so both give the same numbers), else None (the architecture's default)."""
        from attnserve.attention.kernels.mha.extend import verify_extend_config

        if self.extend_config is not None or not step.verify:
            return self.extend_config
        return verify_extend_config(max(step.extend_lens), group, self.pool.head_dim,
                                                         self.pool.device)

    def _extend_tiles(self, step: ExtendStep, group: int, cfg):
        """The step's tile list for this layer's GQA group (layers of one model share it)."""
        from attnserve.attention.kernels.mha.extend import default_extend_config

        cfg = cfg or default_extend_config(self.pool.head_dim, self.pool.device)
        return self._tiles_of(step, cfg.positions_per_tile(group))

    def _prefill_tma_config(self, head_dim: int):
        from attnserve.attention.kernels.mha.prefill_tma import default_prefill_tma_config

        return self.prefill_tma_config or default_prefill_tma_config(head_dim, self.pool.device)

    def _tma_blocker(self, step: ExtendStep, q, layer: AttentionLayer) -> str | None:
        """Why this call cannot take the TMA path (None: it can)."""
        from attnserve.attention.kernels.common import interpreting
        from attnserve.attention.kernels.mha import prefill_tma as tma
        from attnserve.attention.kernels.mha.configs import fast_path_blocker

        if self.prefill_tma is False:
            return "TMA path off"
        blocker = fast_path_blocker(head_dim=layer.head_dim, v_dim=layer.v_head_dim, q_dtype=q.dtype,
                                    kv_dtype=self.pool.dtype, custom_mask=step.custom_mask,
                                    target=target_for(q.device), interpreting=interpreting())
        if blocker is None and step.verify:
            # a few new tokens a request: gathering every prefix's keys per layer costs more than it saves, and a
            # CUDA graph cannot hold buffers sized by the host lengths
            blocker = "verify step"
        if blocker is None and not tma.tma_rows_ok(q):
            blocker = "q layout"
        return blocker

    def _key_slots(self, step: ExtendStep):
        """(slots [rows] int32, kv_starts [B] int32): every request's keys' pool rows, once per step."""
        from attnserve.attention.kernels.mha import prefill_tma as tma

        if step.key_rows is None:
            seq_lens = [p + e for p, e in zip(step.prefix_lens, step.extend_lens)]
            step.key_rows = tma.request_slots(step.meta.kv_indptr, step.meta.kv_indices, seq_lens,
                                              self.pool.page_size, self.pool.device)
        return step.key_rows

    def _tma_key_rows(self, step: ExtendStep, k, v, layer: AttentionLayer):
        """((k_rows, v_rows, kv_starts), None) for prefill_tma, else (None, why not).

        Fresh prompts read the call's own k and v; with a cached prefix every request's keys are gathered
        from the pool into contiguous rows once per layer.
        """
        from attnserve.attention.kernels.mha import prefill_tma as tma

        if not any(step.prefix_lens) and tma.tma_rows_ok(k) and tma.tma_rows_ok(v):
            return (k, v, step.meta.qo_indptr[:-1]), None
        pool = self.pool
        seq_total = sum(step.prefix_lens) + sum(step.extend_lens)
        need = seq_total * pool.num_kv_heads * (layer.head_dim + layer.v_head_dim) * pool.dtype.itemsize
        if need > self.prefill_tma_gather_bytes:
            return None, f"gathering the prefix needs {need >> 20} MiB"
        slots, starts = self._key_slots(step)
        lid = layer.layer_id
        return (tma.gather_request_rows(pool.get_key_buffer(lid), slots),
                tma.gather_request_rows(pool.get_value_buffer(lid), slots), starts), None

    def _extend_layer(self, q, k, v, out, layer: AttentionLayer, step: ExtendStep) -> torch.Tensor:
        from attnserve.attention.kernels.mha.prefill_tma import prefill_tma_attention

        params = self._params_of(layer)
        blocker = self._tma_blocker(step, q, layer)
        if blocker is None:
            gluon_blocker = self._gluon_blocker(step, q, layer, params)
            if gluon_blocker is None:
                return self._gluon_extend(q, k, v, out, layer, step, params)
            rows, blocker = self._tma_key_rows(step, k, v, layer)
            if rows is not None:
                cfg = self._prefill_tma_config(layer.head_dim)
                step.path = "prefill_tma" + (" (warp-specialised)" if cfg.warp_specialize else "")
                if self.prefill_kernel == "gluon":
                    step.path += f" (the Gluon kernel refused: {gluon_blocker})"
                tiles = self._tiles_of(step, cfg.block_m)
                return prefill_tma_attention(q, *rows, out, tiles, step.meta.qo_indptr, step.seq_lens, params,
                                             config=cfg)
        return self._paged_extend(q, out, layer, step, params, blocker)

    def _gluon_extend(self, q, k, v, out, layer: AttentionLayer, step: ExtendStep, params) -> torch.Tensor:
        """The Gluon prefill on a layer it serves: a cached prefix's keys read where they lie in the pool
        (prefill_gluon.READ_POOL_ROWS), else the rows prefill_tma would read (a fresh prompt's own k and v, or
        the prefix gathered)."""
        from attnserve.attention.kernels.mha import prefill_gluon

        if any(step.prefix_lens) and prefill_gluon.READ_POOL_ROWS:
            slots, starts = self._key_slots(step)
            lid = layer.layer_id
            step.path = "prefill_gluon (pool rows)"
            return prefill_gluon.prefill_gluon_attention(
                q, self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid), starts, out,
                self._tiles_of(step, prefill_gluon.BLOCK_M), step.meta.qo_indptr, step.seq_lens, params, slots=slots)
        rows, blocker = self._tma_key_rows(step, k, v, layer)
        if rows is None:  # a gather over its budget
            return self._paged_extend(q, out, layer, step, params, blocker)
        step.path = "prefill_gluon"
        return prefill_gluon.prefill_gluon_attention(q, *rows, out, self._tiles_of(step, prefill_gluon.BLOCK_M),
                                                     step.meta.qo_indptr, step.seq_lens, params)

    def _paged_extend(self, q, out, layer: AttentionLayer, step: ExtendStep, params, why: str) -> torch.Tensor:
        """The FlashAttention-2 style kernel through the page table, where the TMA path does not apply (`why`);
        with prefill_tma=True that is an error instead."""
        from attnserve.attention.kernels.mha.extend import extend_attention

        if self.prefill_tma:
            raise ValueError(f"the TMA prefill path does not apply to this call: {why}")
        step.path = f"paged ({why})"
        lid = layer.layer_id
        cfg = self._extend_config(step, layer.gqa_group)
        return extend_attention(q, self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid), out,
                                self._extend_rows(step, self._extend_tiles(step, layer.gqa_group, cfg)),
                                params, config=cfg)

    def _gluon_blocker(self, step: ExtendStep, q: torch.Tensor, layer: AttentionLayer, params) -> str | None:
        """Why the Gluon prefill does not serve this layer of the step on the TMA path (None: it does)."""
        if self.prefill_kernel == "triton":
            return "prefill_kernel='triton'"
        try:
            from attnserve.attention.kernels.mha import prefill_gluon
        except ImportError as exc:  # a Triton before Gluon's Hopper API (the gpu extra allows 3.2)
            import triton

            return f"Triton {triton.__version__} has no Gluon for Hopper ({exc})"
        why = prefill_gluon.gluon_prefill_supported(q, layer.head_dim, params, None)  # the layer's features
        if why is None and self.prefill_kernel == "auto":
            if step.mean_key_tiles is None:  # the step's lengths: once for every layer
                step.mean_key_tiles = prefill_gluon.mean_key_tiles(step.prefix_lens, step.extend_lens)
            why = prefill_gluon.short_tiles_blocker(step.mean_key_tiles)
        return why

    # ---- decode ----------------------------------------------------------------------------------
    def _decode_layer(self, q: torch.Tensor, out: torch.Tensor, layer: AttentionLayer, meta: TritonStep) -> torch.Tensor:
        from attnserve.attention.kernels.mha.decode import decode_attention

        step = meta.decode
        plan = self.decode_plan(layer, q.dtype)
        lid = layer.layer_id
        return decode_attention(q, self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid), out, step.rows,
                                self._params_of(layer), partials=self._partials_for(step, layer),
                                write_final=step.write_final, config=plan.config, target=plan.signature.target)
