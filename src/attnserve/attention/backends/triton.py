"""triton: attnserve's own Triton kernels behind the backend contract.

Decode is Flash-Decoding (split-KV + log-sum-exp merge, GQA groups on tensor cores).
Extend/prefill takes, per call, one of two kernels: on Hopper the TMA kernel
(kernels/prefill_tma.py: keys as contiguous rows through tensor descriptors, warp-specialised:
the call's own k/v for fresh prompts, each request's keys gathered from the pool when there is
a cached prefix), and everywhere else, or for what it lacks (custom masks, FP8 pools, head
dims other than 64/128/256, a V width unlike K's), the FlashAttention-2 style kernel that reads
the prefix and the new tokens through the page table. `extend_path` names the one that ran. MLA pools (DeepSeek) run the absorbed MLA kernels of
kernels/mla_decode.py and kernels/mla_extend.py over the latent rows with the same plans,
and fresh prompts may run expanded (forward_mla_expanded). plan() builds the CSR metadata,
the per-request split counts and the extend tile list once per step, from host-side
lengths, so nothing here synchronises with the device per layer.

CUDA graphs: init_graph_buffers() allocates fixed metadata buffers; plan_for_capture()
fixes each captured batch size's split dimension (enough splits for one request to fill
the GPU) and plan_for_replay() rewrites the buffers' first rows for the step's lengths.

triton is imported only inside methods: the registry imports this module to read
`features` on machines without it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnserve._lazy import require
from attnserve.attention.base import AttentionBackend, BackendFeatures, ForwardBatch, ForwardMode
from attnserve.attention.metadata import MetadataBuffers, PagedKVMetadata, metadata_for_batch
from attnserve.transfers import to_device

if TYPE_CHECKING:
    from attnserve.attention.layer import AttentionLayer
    from attnserve.kvcache.pool import KVPool


@dataclass
class _DecodePlan:
    meta: PagedKVMetadata
    seq_lens: torch.Tensor  # [B] int32
    num_splits: torch.Tensor  # [B] int32
    max_splits: int  # the grid's split dimension
    write_final: bool  # one split everywhere: stage 1 writes the output itself
    graph_bs: int = 0  # > 0 when these tensors are the fixed graph buffers
    seq_lens_cpu: list[int] | None = None  # host lengths, to re-plan splits when MLA's head groups are learnt


@dataclass
class _ExtendPlan:
    meta: PagedKVMetadata
    seq_lens: torch.Tensor  # [B] int32
    prefix_lens: list[int]
    extend_lens: list[int]
    tiles: dict  # positions per tile -> kernels.extend.ExtendTiles (built at the first layer needing it)
    custom_mask: torch.Tensor | None  # flattened per-request [ext, seq] masks, uint8
    mask_indptr: torch.Tensor | None  # [B] int64 offsets into custom_mask
    expanded: object = None  # kernels.mla_extend.ExpandedPrefillPlan, built at the first expanded MLA layer
    # (kernels.mla_extend_rows.ExtendRowsPlan, its decode tile, None) or (None, None, why not): decided at the
    # step's first MLA layer, which every later layer shares
    mla_rows: tuple | None = None
    key_rows: object = None  # (slots [rows] int64, kv_starts [B] int32) for the TMA path's gathered keys


@dataclass
class _GraphState:
    buffers: MetadataBuffers
    seq_lens: torch.Tensor  # [max_bs] int32
    num_splits: torch.Tensor  # [max_bs] int32
    max_bs: int
    splits_for_bs: dict  # captured batch size -> split dimension of its grid
    partial_storage: dict  # (num_heads, v_dim) -> flat float32 storage for every captured size


class TritonBackend(AttentionBackend):
    name = "triton"
    features = BackendFeatures(
        page_sizes=None,
        kv_dtypes=frozenset({"bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"}),
        attention_types=frozenset({"MHA", "GQA", "MLA"}),
        head_dims=(32, 64, 80, 96, 112, 128, 160, 192, 256),
        asymmetric_kv=True,
        sliding_window=True,
        attention_sinks=True,
        logit_softcap=True,
        custom_mask=True,
        spec_topk1=True,
        spec_topk_gt1=True,
        spec_topk_gt1_paged=True,
        cuda_graph=True,
        devices=frozenset({"cuda"}),
        required_packages=("triton",),
    )

    def __init__(self, pool: KVPool, **options):
        """Options: num_sms, split_waves, min_split_tokens, max_kv_splits (the decode split policy),
        decode_config (kernels.decode.DecodeConfig), extend_config (kernels.extend.ExtendConfig),
        mla_decode_config (kernels.mla_decode.MLADecodeConfig), mla_extend_config (kernels.mla_extend.MLAExtendConfig),
        prefill_tma (None: wherever it applies, the default; False: never; True: raise where it does not apply),
        prefill_tma_config (kernels.prefill_tma.PrefillTmaConfig), prefill_tma_gather_mib (the most memory the TMA
        path may gather a batch's cached keys into, default 1024 MiB; beyond it the paged kernel runs),
        mla_extend_rows (absorbed MLA extend through the decode kernel, a decode row per new token: None, the
        default, wherever the Gluon kernel runs and no mla_extend_config is given; False: never; True: always, on
        the decode tile where Gluon cannot run; custom masks then raise).
        """
        super().__init__(pool, **options)
        require("triton", "the triton attention backend")
        from attnserve.attention.kernels.common import interpreting
        from attnserve.attention.kernels.split_plan import SplitPolicy

        if pool.device.type != "cuda":
            if not interpreting():
                raise ValueError(
                    f"the triton backend runs on CUDA devices, the pool is on {pool.device} "
                    "(TRITON_INTERPRET=1 runs it on the CPU for tests)"
                )
            from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

            let_interpreter_index_with_loaded_scalars()  # loop bounds loaded from memory (tune's CPU race)
        if pool.is_mla:
            rank = pool.kv_lora_rank
            if rank < 16 or rank & (rank - 1):
                raise ValueError(f"kv_lora_rank {rank} unsupported by the triton MLA kernels (a power of two >= 16)")
        elif max(pool.head_dim, pool.v_head_dim) > 256:
            raise ValueError(f"head_dim {max(pool.head_dim, pool.v_head_dim)} unsupported by the triton backend "
                             "(at most 256)")
        unknown = set(options) - {"num_sms", "split_waves", "min_split_tokens", "max_kv_splits",
                                  "decode_config", "extend_config", "mla_decode_config", "mla_extend_config",
                                  "prefill_tma", "prefill_tma_config", "prefill_tma_gather_mib", "mla_extend_rows"}
        if unknown:
            raise ValueError(f"unknown triton backend options {sorted(unknown)}")
        num_sms = options.get("num_sms")
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(pool.device).multi_processor_count if pool.device.type == "cuda" else 4
        self.split_policy = SplitPolicy(
            num_sms=int(num_sms),
            waves=float(options.get("split_waves", 2.0)),
            min_split_tokens=int(options.get("min_split_tokens", 256)),
            max_splits=int(options.get("max_kv_splits", 64)),
        )
        # an MLA tile may carry its own split waves (mla_decode_tiles.json), taken unless split_waves is given
        self._split_waves_given = "split_waves" in options
        self._base_waves = self.split_policy.waves
        self.decode_config = options.get("decode_config")
        self.extend_config = options.get("extend_config")
        self.mla_decode_config = options.get("mla_decode_config")
        self.mla_extend_config = options.get("mla_extend_config")
        self.prefill_tma = options.get("prefill_tma")
        self.prefill_tma_config = options.get("prefill_tma_config")
        self.prefill_tma_gather_bytes = int(options.get("prefill_tma_gather_mib", 1024)) << 20
        self.mla_extend_rows = options.get("mla_extend_rows")
        # which extend kernel the last forward_extend ran, and why the TMA path did not (benchmarks report it)
        self.extend_path: str | None = None
        # programs per (request, split) in MLA decode: head groups of the model's layers, learnt at the first
        # MLA layer (the pool does not know the query heads); the split plan sizes the grid with it
        self._mla_head_groups = 1
        self._decode: _DecodePlan | None = None
        self._extend: _ExtendPlan | None = None
        self._graph: _GraphState | None = None

    # ---- per step ------------------------------------------------------------------------------
    def _extend_tiles(self, plan: _ExtendPlan, group: int):
        """The step's tile list for this layer's GQA group (layers of one model share it)."""
        from attnserve.attention.kernels.extend import default_extend_config
        from attnserve.attention.kernels.mla_extend import default_mla_extend_config

        if self.pool.is_mla:
            cfg = self.mla_extend_config or default_mla_extend_config(self.pool.device)
        else:
            cfg = self.extend_config or default_extend_config(self.pool.head_dim, self.pool.device)
        return self._tiles_of(plan, cfg.positions_per_tile(group))

    def _tiles_of(self, plan: _ExtendPlan, positions: int):
        from attnserve.attention.kernels.extend import build_extend_tiles

        if positions not in plan.tiles:
            plan.tiles[positions] = build_extend_tiles(plan.prefix_lens, plan.extend_lens, positions, self.pool.device)
        return plan.tiles[positions]

    def _prefill_tma_config(self, head_dim: int):
        from attnserve.attention.kernels.prefill_tma import default_prefill_tma_config

        return self.prefill_tma_config or default_prefill_tma_config(head_dim, self.pool.device)

    def _tma_key_rows(self, plan: _ExtendPlan, q, k, v, layer: AttentionLayer):
        """((k_rows, v_rows, kv_starts), None) when this call takes the TMA path, else (None, why not).

        Fresh prompts read the call's own k and v; with a cached prefix every request's keys are gathered
        from the pool into contiguous rows once per layer.
        """
        from attnserve.attention.kernels.common import interpreting
        from attnserve.attention.kernels.prefill_tma import (
            fast_path_blocker,
            gather_request_rows,
            request_slots,
            tma_rows_ok,
        )
        from attnserve.attention.kernels.tiles import target_for

        if self.prefill_tma is False:
            return None, "TMA path off"
        pool = self.pool
        blocker = fast_path_blocker(head_dim=layer.head_dim, v_dim=layer.v_head_dim, q_dtype=q.dtype,
                                    kv_dtype=pool.dtype, custom_mask=plan.custom_mask, target=target_for(q.device),
                                    interpreting=interpreting())
        if blocker is None and not tma_rows_ok(q):
            blocker = "q layout"
        rows = None
        if blocker is None:
            if not any(plan.prefix_lens) and tma_rows_ok(k) and tma_rows_ok(v):
                rows = (k, v, plan.meta.qo_indptr[:-1])
            else:
                seq_total = sum(plan.prefix_lens) + sum(plan.extend_lens)
                need = seq_total * pool.num_kv_heads * (layer.head_dim + layer.v_head_dim) * pool.dtype.itemsize
                if need > self.prefill_tma_gather_bytes:
                    blocker = f"gathering the prefix needs {need >> 20} MiB"
                else:
                    if plan.key_rows is None:
                        seq_lens = [p + e for p, e in zip(plan.prefix_lens, plan.extend_lens)]
                        plan.key_rows = request_slots(plan.meta.kv_indptr, plan.meta.kv_indices, seq_lens,
                                                      pool.page_size, pool.device)
                    slots, starts = plan.key_rows
                    lid = layer.layer_id
                    rows = (gather_request_rows(pool.get_key_buffer(lid), slots),
                            gather_request_rows(pool.get_value_buffer(lid), slots), starts)
        if rows is None and self.prefill_tma:
            raise ValueError(f"the TMA prefill path does not apply to this call: {blocker}")
        return rows, blocker

    def plan(self, fb: ForwardBatch) -> None:
        self._decode = None
        self._extend = None
        if fb.mode is ForwardMode.IDLE or fb.batch_size == 0:
            return
        meta = metadata_for_batch(fb)
        seq_lens = fb.seq_lens.to(device=self.pool.device, dtype=torch.int32)
        if fb.mode.is_decode and fb.custom_mask is None:
            self._decode = self._plan_decode(fb.seq_lens_cpu, meta, seq_lens)
        else:
            self._extend = self._plan_extend(fb, meta, seq_lens)

    def _plan_decode(self, seq_lens_cpu: list[int], meta: PagedKVMetadata, seq_lens: torch.Tensor,
                     max_splits: int | None = None) -> _DecodePlan:
        from attnserve.attention.kernels.split_plan import plan_kv_splits

        splits = plan_kv_splits(seq_lens_cpu, self._programs_per_split(), self.split_policy, max_splits)
        grid_splits = max(splits)
        num_splits = to_device(splits, self.pool.device, torch.int32)  # [B]
        return _DecodePlan(meta, seq_lens, num_splits, grid_splits, write_final=grid_splits == 1,
                           seq_lens_cpu=list(seq_lens_cpu))

    def _programs_per_split(self) -> int:
        """What the split plan counts per (request, split): KV heads, or MLA's head groups."""
        return self._mla_head_groups if self.pool.is_mla else self.pool.num_kv_heads

    def _plan_extend(self, fb: ForwardBatch, meta: PagedKVMetadata, seq_lens: torch.Tensor) -> _ExtendPlan:
        mask = mask_indptr = None
        if fb.custom_mask is not None:
            sizes = [e * s for e, s in zip(fb.extend_lens_cpu, fb.seq_lens_cpu)]
            if fb.custom_mask.numel() != sum(sizes):
                raise ValueError(f"custom_mask has {fb.custom_mask.numel()} entries, the batch needs {sum(sizes)}")
            mask = fb.custom_mask.to(self.pool.device)
            mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
            offsets = [0] + list(itertools.accumulate(sizes))[:-1]
            mask_indptr = torch.tensor(offsets, dtype=torch.int64).to(self.pool.device, non_blocking=True)  # [B]
        return _ExtendPlan(meta, seq_lens, fb.prefix_lens_cpu, list(fb.extend_lens_cpu), {}, mask, mask_indptr)

    # ---- KV store --------------------------------------------------------------------------------
    def store_kv(self, layer: AttentionLayer, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor | None) -> None:
        from attnserve.attention.kernels.store import store_kv

        lid = layer.layer_id
        if self.pool.is_mla:  # one latent row per token; V is a view of it
            store_kv(self.pool.get_key_buffer(lid), None, fb.out_cache_loc, k, None, self.pool.k_scale[lid])
            return
        store_kv(self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid), fb.out_cache_loc, k, v,
                 self.pool.k_scale[lid], self.pool.v_scale[lid])

    # ---- forward ---------------------------------------------------------------------------------
    def _check_layer(self, q: torch.Tensor, layer: AttentionLayer) -> None:
        if layer.is_mla != self.pool.is_mla:
            raise ValueError(f"layer {layer.layer_id} is {'MLA' if layer.is_mla else 'MHA'} but the pool is "
                             f"{'MLA' if self.pool.is_mla else 'MHA'}")
        if q.dim() != 3 or q.shape[1] != layer.num_heads or q.shape[2] != layer.head_dim:
            raise ValueError(f"q shape {tuple(q.shape)} does not match [tokens, {layer.num_heads}, {layer.head_dim}]")

    def forward_extend(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        from attnserve.attention.kernels.extend import extend_attention

        self._check_layer(q, layer)
        plan = self._extend
        if plan is None:
            raise ValueError(f"no extend plan for this step (mode {fb.mode.value}); call plan(fb) first")
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)  # [T, Hq, Dv]
        lid = layer.layer_id
        if self.pool.is_mla:
            from attnserve.attention.kernels.mla_extend import mla_extend_attention
            from attnserve.attention.kernels.mla_extend_rows import mla_extend_rows_attention

            rows, rows_config, blocker = self._mla_extend_rows(plan, q, layer)
            if rows is not None:
                tokens = rows.token_groups[2] if rows.token_groups else 1
                self.extend_path = f"mla decode rows ({rows_config.kernel}, {tokens} token{'s' * (tokens > 1)} a CTA)"
                return mla_extend_rows_attention(q, self.pool.get_key_buffer(lid), out, rows, plan.meta.kv_indices,
                                                 self.pool.page_size, layer.scaling, self.pool.kv_lora_rank,
                                                 self.pool.k_scale[lid], config=rows_config)
            self.extend_path = f"mla tiles ({blocker})"
            return mla_extend_attention(
                q, self.pool.get_key_buffer(lid), out, self._extend_tiles(plan, layer.gqa_group),
                plan.meta.qo_indptr, plan.meta.kv_indptr, plan.meta.kv_indices, plan.seq_lens, self.pool.page_size,
                layer.scaling, self.pool.kv_lora_rank, self.pool.k_scale[lid], plan.custom_mask, plan.mask_indptr,
                config=self.mla_extend_config,
            )
        rows, blocker = self._tma_key_rows(plan, q, k, v, layer)
        if rows is not None:
            from attnserve.attention.kernels.prefill_tma import prefill_tma_attention

            cfg = self._prefill_tma_config(layer.head_dim)
            self.extend_path = "prefill_tma" + (" (warp-specialised)" if cfg.warp_specialize else "")
            tiles = self._tiles_of(plan, cfg.block_m)
            return prefill_tma_attention(q, *rows, out, tiles, plan.meta.qo_indptr, plan.seq_lens, layer.scaling,
                                         layer.sliding_window, layer.logit_cap, layer.sinks, config=cfg)
        self.extend_path = f"paged ({blocker})"
        return extend_attention(
            q, self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid), out,
            self._extend_tiles(plan, layer.gqa_group),
            plan.meta.qo_indptr, plan.meta.kv_indptr, plan.meta.kv_indices, plan.seq_lens, self.pool.page_size,
            layer.scaling, self.pool.k_scale[lid], self.pool.v_scale[lid], layer.sliding_window, layer.logit_cap,
            layer.sinks, plan.custom_mask, plan.mask_indptr, config=self.extend_config,
        )

    def _mla_extend_rows(self, plan: _ExtendPlan, q: torch.Tensor, layer: AttentionLayer):
        """(the step's decode-row plan, its decode tile, None) when this MLA extend runs as decode rows, else
        (None, None, why not). By default where the Gluon kernel runs (any head count: with fewer than 64 heads a
        CTA takes several tokens); forced (mla_extend_rows=True) elsewhere on the decode tile, a token a CTA."""
        from attnserve.attention.kernels.mla_decode import (
            gluon_mla_decode_unsupported,
            head_groups,
            runnable_mla_decode_config,
        )
        from attnserve.attention.kernels.mla_extend_rows import GLUON_ROWS_CONFIG, MAX_ROWS, plan_extend_rows

        if plan.mla_rows is not None:
            return plan.mla_rows
        pool = self.pool
        gluon_blocker = gluon_mla_decode_unsupported(q, pool.get_key_buffer(layer.layer_id), pool.kv_lora_rank)
        if self.mla_extend_rows is False:
            blocker = "decode rows off"
        elif plan.custom_mask is not None:
            blocker = "custom mask"
        elif q.shape[0] > MAX_ROWS:
            blocker = f"{q.shape[0]} new tokens exceed the grid's {MAX_ROWS} rows"
        elif self.mla_extend_rows:
            blocker = None
        elif self.mla_extend_config is not None:
            blocker = "an extend tile was given"
        else:
            blocker = gluon_blocker
        if blocker is not None:
            if self.mla_extend_rows:
                raise ValueError(f"MLA extend as decode rows does not apply to this call: {blocker}")
            plan.mla_rows = (None, None, blocker)
            return plan.mla_rows
        if gluon_blocker is None:
            from attnserve.attention.kernels.mla_decode_gluon import head_groups_per_cta_row, tokens_per_cta

            cfg, tokens = GLUON_ROWS_CONFIG, tokens_per_cta(layer.num_heads)
            programs = head_groups_per_cta_row(layer.num_heads, tokens)
        else:
            cfg = self.mla_decode_config or runnable_mla_decode_config(
                q, pool.get_key_buffer(layer.layer_id), pool.kv_lora_rank, pool.page_size)
            tokens, programs = 1, head_groups(layer.num_heads, cfg)
        policy = self.split_policy
        if cfg.split_waves and not self._split_waves_given:
            policy = dataclasses.replace(policy, waves=cfg.split_waves)
        rows = plan_extend_rows(plan.prefix_lens, plan.extend_lens, pool.page_size, pool.device, programs, policy,
                                tokens)
        plan.mla_rows = (rows, cfg, None)
        return plan.mla_rows

    def mla_expanded_applies(self, fb: ForwardBatch) -> bool:
        """Whether this step may run expanded MLA: an MLA pool and fresh prompts only (no cached prefix, no mask)."""
        plan = self._extend
        return (self.pool.is_mla and plan is not None and plan.custom_mask is None
                and not any(plan.prefix_lens))

    def forward_mla_expanded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                             fb: ForwardBatch) -> torch.Tensor:
        """Fresh prompts of an MLA model over their latent expanded per head: 3.4x fewer FLOPs than absorbed.

        q, k `[T, H, nope + rope]`, v `[T, H, v_head_dim]` (narrower than k) -> `[T, H, v_head_dim]`. The latent
        rows still go to the pool (store_kv) for the decode steps that follow.
        """
        from attnserve.attention.kernels.mla_extend import mla_expanded_prefill, plan_expanded_prefill

        if not self.mla_expanded_applies(fb):
            raise ValueError("expanded MLA runs fresh prompts of an MLA model only (no cached prefix, no custom mask)")
        plan = self._extend
        if plan.expanded is None:
            plan.expanded = plan_expanded_prefill(plan.extend_lens, q.shape[-1], self.pool.device)
        return mla_expanded_prefill(q, k, v, plan.expanded, layer.scaling)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        from attnserve.attention.kernels.decode import decode_attention

        if self._decode is None and self._extend is not None:
            return self.forward_extend(q, None, None, layer, fb)  # decode with a custom mask
        self._check_layer(q, layer)
        plan = self._decode
        if plan is None:
            raise ValueError("no decode plan for this step; call plan(fb) or plan_for_replay(fb) first")
        q = q if q.stride(-1) == 1 else q.contiguous()
        bs = q.shape[0]
        out = q.new_empty(bs, layer.num_heads, layer.v_head_dim)  # [B, Hq, Dv]
        if self.pool.is_mla:
            plan = self._learn_mla_head_groups(plan, layer.num_heads)
        partials = None
        if plan.graph_bs and not plan.write_final:
            partials = self._graph_partials(layer.num_heads, layer.v_head_dim, plan.graph_bs, plan.max_splits)
        lid = layer.layer_id
        if self.pool.is_mla:
            from attnserve.attention.kernels.mla_decode import mla_decode_attention

            return mla_decode_attention(
                q, self.pool.get_key_buffer(lid), out, plan.meta.kv_indptr, plan.meta.kv_indices, plan.seq_lens,
                plan.num_splits, plan.max_splits, self.pool.page_size, layer.scaling, self.pool.kv_lora_rank,
                self.pool.k_scale[lid], partials=partials, write_final=plan.write_final,
                config=self.mla_decode_config,
            )
        return decode_attention(
            q, self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid), out,
            plan.meta.kv_indptr, plan.meta.kv_indices, plan.seq_lens, plan.num_splits, plan.max_splits,
            self.pool.page_size, layer.scaling, self.pool.k_scale[lid], self.pool.v_scale[lid],
            layer.sliding_window, layer.logit_cap, layer.sinks, partials=partials,
            write_final=plan.write_final, config=self.decode_config,
        )

    def _learn_mla_head_groups(self, plan: _DecodePlan, num_heads: int) -> _DecodePlan:
        """The first MLA layer tells how many head groups each split runs; an eager plan is re-made for it.

        A graph plan keeps its splits (any count up to the captured grid is correct); later plans use it.
        """
        from attnserve.attention.kernels.mla_decode import default_mla_decode_config, head_groups

        cfg = self.mla_decode_config or default_mla_decode_config(self.pool.device, None, num_heads,
                                                                  self.pool.page_size)
        groups = head_groups(num_heads, cfg)
        waves = cfg.split_waves if cfg.split_waves and not self._split_waves_given else self.split_policy.waves
        if groups == self._mla_head_groups and waves == self.split_policy.waves:
            return plan
        self._mla_head_groups = groups
        self.split_policy = dataclasses.replace(self.split_policy, waves=waves)
        if plan.graph_bs or plan.seq_lens_cpu is None:
            return plan
        self._decode = self._plan_decode(plan.seq_lens_cpu, plan.meta, plan.seq_lens)
        return self._decode

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def init_graph_buffers(self, max_bs: int, max_tokens: int) -> None:
        """Metadata buffers for up to max_bs requests; kv_indices is sized when the first batch is captured."""
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        dev = self.pool.device
        self.graph_max_bs = max_bs
        self._graph = _GraphState(
            buffers=MetadataBuffers.allocate(max_bs, 0, dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),  # [max_bs]
            num_splits=torch.ones(max_bs, dtype=torch.int32, device=dev),  # [max_bs]
            max_bs=max_bs,
            splits_for_bs={},
            partial_storage={},
        )

    def _graph_plan(self, fb: ForwardBatch, capturing: bool) -> None:
        from attnserve.attention.kernels.split_plan import max_splits_for_batch, plan_kv_splits

        g = self._graph
        if g is None:
            raise ValueError("call init_graph_buffers() before planning a CUDA-graph batch")
        if not fb.mode.is_decode or fb.custom_mask is not None:
            raise ValueError(f"the triton backend captures plain decode batches only, got mode {fb.mode.value}")
        bs = fb.batch_size
        if bs > g.max_bs:
            raise ValueError(f"batch {bs} exceeds the graph buffers' max_bs {g.max_bs}")
        width_pages = math.ceil(fb.req_to_token.shape[1] / self.pool.page_size)
        if g.buffers.kv_indices.numel() < g.max_bs * width_pages:
            if not capturing:
                raise ValueError("plan_for_replay() before any plan_for_capture()")
            g.buffers.kv_indices = torch.zeros(g.max_bs * width_pages, dtype=torch.int32, device=self.pool.device)
        if capturing:
            g.splits_for_bs[bs] = max_splits_for_batch(bs, self._programs_per_split(), self.split_policy)
        elif bs not in g.splits_for_bs:
            raise ValueError(f"batch size {bs} was never captured (captured: {sorted(g.splits_for_bs)})")
        grid_splits = g.splits_for_bs[bs]
        meta = metadata_for_batch(fb, buffers=g.buffers)
        g.seq_lens[:bs].copy_(fb.seq_lens.to(torch.int32), non_blocking=True)
        splits = plan_kv_splits(fb.seq_lens_cpu, self._programs_per_split(), self.split_policy, grid_splits)
        g.num_splits[:bs].copy_(to_device(splits, self.pool.device, torch.int32))
        self._extend = None
        self._decode = _DecodePlan(meta, g.seq_lens[:bs], g.num_splits[:bs], grid_splits,
                                   write_final=grid_splits == 1, graph_bs=bs)

    def _graph_partials(self, num_heads: int, v_dim: int, bs: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one flat float32 storage sized for the largest bs * splits of any capturable batch."""
        from attnserve.attention.kernels.split_plan import max_splits_for_batch

        g = self._graph
        key = (num_heads, v_dim)
        if key not in g.partial_storage:
            # MLA's head groups may be learnt after a capture: size for one program per split, the most splits
            programs = 1 if self.pool.is_mla else self.pool.num_kv_heads
            # an MLA tile's waves are learnt at the first layer, after the first capture's grid was planned with
            # the constructed policy's: size for whichever gives more splits
            policy = dataclasses.replace(self.split_policy, waves=max(self.split_policy.waves, self._base_waves))
            most = max(b * max_splits_for_batch(b, programs, policy) for b in range(1, g.max_bs + 1))
            g.partial_storage[key] = (
                torch.empty(most * num_heads * v_dim, dtype=torch.float32, device=self.pool.device),
                torch.empty(most * num_heads, dtype=torch.float32, device=self.pool.device),
            )
        o_flat, lse_flat = g.partial_storage[key]
        n = bs * num_heads * splits
        return o_flat[: n * v_dim].view(bs, num_heads, splits, v_dim), lse_flat[:n].view(bs, num_heads, splits)

    def plan_for_capture(self, fb: ForwardBatch) -> None:
        self._graph_plan(fb, capturing=True)

    def plan_for_replay(self, fb: ForwardBatch) -> None:
        self._graph_plan(fb, capturing=False)

