"""The Triton backends' shared part: options, the per-step plans, the KV store and CUDA-graph buffers.

Decode is Flash-Decoding (split-KV + log-sum-exp merge). plan() builds the CSR metadata, the per-request split
counts and the extend tile list once per step, from host-side lengths, so nothing here synchronises with the
device per layer.

A MIXED step (the scheduler's running decodes first, one token each, then prompt chunks) runs in two parts
where the family allows it (`SPLIT_MIXED`, MHA): the leading one-token rows through the decode kernel, which
shares each KV read among a GQA group and splits long contexts over the SMs, and only the prompt chunks through
the extend path. Through the extend path alone every decode would be a whole query tile per head (one row of
128 used) over its whole context, and the TMA kernel would gather every decode's keys into contiguous rows per
layer first: on a 64-stream batch that costs many times the decode step's own attention in every mixed step.
`split_mixed=False` (a backend option) runs the whole step through the extend path, as before. Which kernel a layer runs, on which tile and with which split policy, is its KernelPlan
(attention/kernels/plan.py), resolved once per layer signature; mha.py and mla.py say what each family resolves.

CUDA graphs: init_graph_buffers() allocates fixed metadata buffers; plan_for_capture() fixes each captured
batch size's split dimension (enough splits for one request to fill the GPU) and plan_for_replay() rewrites
the buffers' first rows for the step's lengths. Speculative verify steps (TARGET_VERIFY, q tokens for every
request) are captured too, per (batch size, q, tree or chain): they run the paged extend kernel over a tile list
that does not depend on the lengths, and a tree's mask is the compact one over the new tokens (`[bs, q, q]`,
the prefix visible to every row), so its size is fixed while the prefixes grow.

The kernel modules import triton, and the registry imports this package to read `features` on machines
without it: the backends import each kernel where they call it (the constructor asks for triton first).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnserve._lazy import require
from attnserve.attention.base import (
    EVERY_LAYER_VARIANT,
    EVERY_VERIFY_SHAPE,
    AttentionBackend,
    BackendFeatures,
)
from attnserve.attention.kernels.params import DecodeRows, ExtendRows, LayerParams
from attnserve.attention.kernels.plan import KernelPlan
from attnserve.attention.kernels.split_plan import SplitPolicy, max_splits_for_batch, plan_kv_splits
from attnserve.attention.metadata import (
    MetadataBuffers,
    PagedKVMetadata,
    build_paged_metadata,
    metadata_for_batch,
)
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.transfers import to_device

if TYPE_CHECKING:
    from attnserve.attention.layer import AttentionLayer
    from attnserve.kvcache.pool import KVPool



COMMON_OPTIONS = frozenset({"num_sms", "split_waves", "min_split_tokens", "max_kv_splits", "split_mixed"})
FEATURES = BackendFeatures(
    page_sizes=None,
    kv_dtypes=frozenset({"bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"}),
    attention_types=frozenset({"MHA", "GQA", "MLA"}),
    head_dims=(32, 64, 80, 96, 112, 128, 160, 192, 256),
    asymmetric_kv=True,
    **EVERY_LAYER_VARIANT,
    **EVERY_VERIFY_SHAPE,
    cuda_graph=True,
    devices=frozenset({"cuda"}),
    required_packages=("triton",),
)


@dataclass
class DecodeStep:
    meta: PagedKVMetadata
    seq_lens: torch.Tensor  # [B] int32
    num_splits: torch.Tensor  # [B] int32
    max_splits: int  # the grid's split dimension
    write_final: bool  # one split everywhere: stage 1 writes the output itself
    graph_bs: int = 0  # > 0 when these tensors are the fixed graph buffers
    seq_lens_cpu: list[int] | None = None  # host lengths, to re-plan splits once a layer's kernel plan is known
    rows: DecodeRows | None = None  # what the decode wrappers read of this step, built with it

    def __post_init__(self):
        self.rows = DecodeRows(self.meta.kv_indptr, self.meta.kv_indices, self.seq_lens, self.num_splits,
                               self.max_splits, self.meta.page_size)


@dataclass
class ExtendStep:
    meta: PagedKVMetadata
    seq_lens: torch.Tensor  # [B] int32
    prefix_lens: list[int]
    extend_lens: list[int]
    tiles: dict  # positions per tile -> kernels.extend_tiles.ExtendTiles (built at the first layer needing it)
    custom_mask: torch.Tensor | None  # flattened per-request [ext, seq] masks, uint8
    mask_indptr: torch.Tensor | None  # [B] int64 offsets into custom_mask
    expanded: object = None  # kernels.mha.extend.ExpandedPrefillPlan, built at the first expanded MLA layer
    # (kernels.mla.extend_rows.ExtendRowsPlan, its KernelPlan, None) or (None, None, why not): decided at the
    # step's first MLA layer, which every later layer shares
    mla_rows: tuple | None = None
    key_rows: object = None  # (slots [rows] int32, kv_starts [B] int32): every request's keys' pool rows (TMA path)
    mean_key_tiles: float | None = None  # key tiles a 128-row query tile reads (the Gluon prefill's rule)
    verify: bool = False  # a TARGET_VERIFY step: a few new tokens a request over a long prefix
    mask_new_keys_only: bool = False  # custom_mask is per request [ext, ext] over the new tokens (a tree's)
    path: str | None = None  # which extend kernel the step's last layer ran, and why not the faster one


@dataclass
class TritonStep:
    """What plan() built for one step: a decode plan, an extend plan, or both (a MIXED step split in two)."""

    decode: DecodeStep | None = None
    extend: ExtendStep | None = None
    mixed_decode_rows: int = 0  # a MIXED step's leading rows run through the decode kernel

    @property
    def extend_path(self) -> str | None:
        """Which extend kernel ran (as the kernel race reports it), or None before any extend layer."""
        return self.extend.path if self.extend is not None else None


@dataclass
class GraphState:
    buffers: MetadataBuffers
    seq_lens: torch.Tensor  # [max_bs] int32
    num_splits: torch.Tensor  # [max_bs] int32
    max_bs: int
    splits_for_bs: dict  # captured batch size -> split dimension of its grid
    partial_storage: dict  # (num_heads, v_dim) -> flat float32 storage for every captured size
    verify_steps: dict  # (batch size, tokens per request, tree) -> the captured verify ExtendStep


class TritonBackendBase(AttentionBackend):
    """What the MHA and MLA Triton backends share. A subclass names its OPTIONS and implements
    `_decode_layer`, `_extend_layer`, `_programs_per_split` and `_graph_programs`."""

    name = "triton"
    features = FEATURES
    OPTIONS: frozenset = frozenset()
    SPLIT_MIXED = False  # the family runs a MIXED step's leading decodes through its decode kernel

    def __init__(self, pool: KVPool, **options):
        super().__init__(pool, **options)
        require("triton", "the triton attention backend")  # before the kernel modules, which import it
        from attnserve.attention.kernels.common import interpreting
        from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

        if pool.device.type != "cuda":
            if not interpreting():
                raise ValueError(
                    f"the triton backend runs on CUDA devices, the pool is on {pool.device} "
                    "(TRITON_INTERPRET=1 runs it on the CPU for tests)"
                )
            let_interpreter_index_with_loaded_scalars()  # loop bounds loaded from memory (tune's CPU race)
        unknown = set(options) - COMMON_OPTIONS - self.OPTIONS
        if unknown:
            raise ValueError(f"unknown triton backend options {sorted(unknown)}")
        num_sms = options.get("num_sms")
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(pool.device).multi_processor_count if pool.device.type == "cuda" else 4
        default = SplitPolicy()
        self.split_policy = SplitPolicy(
            num_sms=int(num_sms),
            waves=float(options.get("split_waves", default.waves)),
            min_split_tokens=int(options.get("min_split_tokens", default.min_split_tokens)),
            max_splits=int(options.get("max_kv_splits", default.max_splits)),
        )
        # a tile may carry its own split waves (mla/decode_table.json), taken unless split_waves is given
        self._split_waves_given = "split_waves" in options
        self._base_policy = self.split_policy
        self._kernel_plans: dict = {}  # layer signature -> KernelPlan, resolved once each
        self._graph: GraphState | None = None
        # MIXED steps: the leading decode rows through the decode kernel (module docstring)
        self.split_mixed = bool(options.get("split_mixed", True)) and self.SPLIT_MIXED

    # ---- per family ------------------------------------------------------------------------------
    def _programs_per_split(self) -> int:
        """What the split plan counts per (request, split): KV heads, or MLA's head groups."""
        raise NotImplementedError

    def _graph_programs(self) -> int:
        """Programs per split the graph partial buffers are sized for (the fewest: the most splits)."""
        raise NotImplementedError

    def kernel_plans(self) -> list[KernelPlan]:
        """The kernel plans resolved so far, one per layer signature."""
        return list(self._kernel_plans.values())

    # ---- per step ------------------------------------------------------------------------------
    def _tiles_of(self, step: ExtendStep, positions: int):
        from attnserve.attention.kernels.extend_tiles import build_extend_tiles

        if positions not in step.tiles:
            step.tiles[positions] = build_extend_tiles(step.prefix_lens, step.extend_lens, positions, self.pool.device)
        return step.tiles[positions]

    def plan(self, fb: ForwardBatch) -> TritonStep:
        if fb.mode is ForwardMode.IDLE or fb.batch_size == 0:
            return TritonStep()
        nd = self._leading_decodes(fb)
        if nd:
            return self._plan_mixed(fb, nd)
        meta = metadata_for_batch(fb)
        seq_lens = fb.seq_lens.to(device=self.pool.device, dtype=torch.int32)
        if fb.mode.is_decode and fb.custom_mask is None:
            return TritonStep(decode=self._plan_decode(fb.seq_lens_cpu, meta, seq_lens))
        return TritonStep(extend=self._plan_extend(fb, meta, seq_lens))

    def _leading_decodes(self, fb: ForwardBatch) -> int:
        """Rows of a MIXED step the decode kernel runs: its leading one-token requests (the scheduler puts
        the running decodes first). A one-token row attends to every key of its request, as a decode does,
        whether it decodes or ends a prompt. 0: the whole step takes the extend path."""
        if not self.split_mixed or fb.mode is not ForwardMode.MIXED or fb.custom_mask is not None:
            return 0
        n = 0
        for e in fb.extend_lens_cpu:
            if e != 1:
                break
            n += 1
        return n

    def _plan_mixed(self, fb: ForwardBatch, nd: int) -> TritonStep:
        """A decode plan over the first nd requests and an extend plan over the rest, each with its own CSR
        metadata (from the host lengths: no sync)."""
        dev = self.pool.device
        ps = self.pool.page_size
        rows, seq, ext = fb.req_pool_indices, fb.seq_lens, fb.extend_lens
        seq_cpu = fb.seq_lens_cpu
        meta = build_paged_metadata(fb.req_to_token, rows[:nd], seq[:nd], ext[:nd], ps, seq_lens_cpu=seq_cpu[:nd])
        step = TritonStep(decode=self._plan_decode(seq_cpu[:nd], meta, seq[:nd].to(device=dev, dtype=torch.int32)),
                          mixed_decode_rows=nd)
        if nd < fb.batch_size:
            meta = build_paged_metadata(fb.req_to_token, rows[nd:], seq[nd:], ext[nd:], ps,
                                        seq_lens_cpu=seq_cpu[nd:])
            step.extend = ExtendStep(meta, seq[nd:].to(device=dev, dtype=torch.int32), fb.prefix_lens_cpu[nd:],
                                     list(fb.extend_lens_cpu[nd:]), {}, None, None)
        return step

    def _plan_decode(self, seq_lens_cpu: list[int], meta: PagedKVMetadata, seq_lens: torch.Tensor,
                     max_splits: int | None = None) -> DecodeStep:
        splits = plan_kv_splits(seq_lens_cpu, self._programs_per_split(), self.split_policy, max_splits)
        grid_splits = max(splits)
        num_splits = to_device(splits, self.pool.device, torch.int32)  # [B]
        return DecodeStep(meta, seq_lens, num_splits, grid_splits, write_final=grid_splits == 1,
                          seq_lens_cpu=list(seq_lens_cpu))

    def _plan_extend(self, fb: ForwardBatch, meta: PagedKVMetadata, seq_lens: torch.Tensor) -> ExtendStep:
        mask = mask_indptr = None
        if fb.custom_mask is not None:
            sizes = [e * s for e, s in zip(fb.extend_lens_cpu, fb.seq_lens_cpu)]
            if fb.custom_mask.numel() != sum(sizes):
                raise ValueError(f"custom_mask has {fb.custom_mask.numel()} entries, the batch needs {sum(sizes)}")
            mask = fb.custom_mask.to(self.pool.device)
            mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
            offsets = [0] + list(itertools.accumulate(sizes))[:-1]
            mask_indptr = to_device(offsets, self.pool.device)  # [B] int64
        return ExtendStep(meta, seq_lens, fb.prefix_lens_cpu, list(fb.extend_lens_cpu), {}, mask, mask_indptr,
                          verify=fb.mode is ForwardMode.TARGET_VERIFY)

    def _extend_rows(self, step: ExtendStep, tiles) -> ExtendRows:
        meta = step.meta
        return ExtendRows(tiles, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, step.seq_lens, self.pool.page_size,
                          step.custom_mask, step.mask_indptr, step.mask_new_keys_only)

    def _params_of(self, layer: AttentionLayer) -> LayerParams:
        """The layer's scales (the pool's K/V scales as they are now: FP8 scales may be set after the build)."""
        lid = layer.layer_id
        return LayerParams(layer.scaling, self.pool.k_scale[lid], self.pool.v_scale[lid], layer.sliding_window,
                           layer.logit_cap, layer.sinks)

    # ---- forward ---------------------------------------------------------------------------------
    def _check_layer(self, q: torch.Tensor, layer: AttentionLayer) -> None:
        if layer.is_mla != self.pool.is_mla:
            raise ValueError(f"layer {layer.layer_id} is {'MLA' if layer.is_mla else 'MHA'} but the pool is "
                             f"{'MLA' if self.pool.is_mla else 'MHA'}")
        if q.dim() != 3 or q.shape[1] != layer.num_heads or q.shape[2] != layer.head_dim:
            raise ValueError(f"q shape {tuple(q.shape)} does not match [tokens, {layer.num_heads}, {layer.head_dim}]")

    def forward_extend(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch, meta: TritonStep) -> torch.Tensor:
        self._check_layer(q, layer)
        if meta.mixed_decode_rows:
            return self._forward_mixed(q, k, v, layer, meta)
        step = meta.extend
        if step is None:
            raise ValueError(f"no extend plan for this step (mode {fb.mode.value}); call plan(fb) first")
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)  # [T, Hq, Dv]
        return self._extend_layer(q, k, v, out, layer, step)

    def _forward_mixed(self, q, k, v, layer: AttentionLayer, step: TritonStep) -> torch.Tensor:
        """A MIXED step planned in two parts: rows [0, nd) through the decode kernel, the rest through the
        extend path, each writing its rows of one output."""
        nd = step.mixed_decode_rows
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)  # [T, Hq, Dv]
        self._decode_layer(q[:nd], out[:nd], layer, step)
        if step.extend is not None:
            self._extend_layer(q[nd:], k[nd:] if k is not None else None, v[nd:] if v is not None else None,
                               out[nd:], layer, step.extend)
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch, meta: TritonStep) -> torch.Tensor:
        if meta.decode is None and meta.extend is not None:
            return self.forward_extend(q, None, None, layer, fb, meta)  # decode with a custom mask
        self._check_layer(q, layer)
        if meta.decode is None:
            raise ValueError(f"no decode plan in this step's metadata (mode {fb.mode.value})")
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)  # [B, Hq, Dv]
        return self._decode_layer(q, out, layer, meta)

    def _partials_for(self, step: DecodeStep, layer: AttentionLayer):
        """The graph's fixed partial buffers for this step, or None (the wrapper allocates its own)."""
        if step.graph_bs and not step.write_final:
            return self._graph_partials(layer.num_heads, layer.v_head_dim, step.graph_bs, step.max_splits)
        return None

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def init_graph_buffers(self, max_bs: int, max_tokens: int) -> None:
        """Metadata buffers for up to max_bs requests; kv_indices is sized when the first batch is captured."""
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        dev = self.pool.device
        self.graph_max_bs = max_bs
        self._graph = GraphState(
            buffers=MetadataBuffers.allocate(max_bs, 0, dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),  # [max_bs]
            num_splits=torch.ones(max_bs, dtype=torch.int32, device=dev),  # [max_bs]
            max_bs=max_bs,
            splits_for_bs={},
            partial_storage={},
            verify_steps={},
        )

    def _graph_state(self, fb: ForwardBatch, capturing: bool) -> GraphState:
        """The graph buffers, kv_indices sized for the widest request the table allows at the first capture."""
        g = self._graph
        if g is None:
            raise ValueError("call init_graph_buffers() before planning a CUDA-graph batch")
        if fb.batch_size > g.max_bs:
            raise ValueError(f"batch {fb.batch_size} exceeds the graph buffers' max_bs {g.max_bs}")
        width_pages = math.ceil(fb.req_to_token.shape[1] / self.pool.page_size)
        if g.buffers.kv_indices.numel() < g.max_bs * width_pages:
            if not capturing:
                raise ValueError("plan_for_replay() before any plan_for_capture()")
            g.buffers.kv_indices = torch.zeros(g.max_bs * width_pages, dtype=torch.int32, device=self.pool.device)
        return g

    def _graph_plan(self, fb: ForwardBatch, capturing: bool) -> TritonStep:
        if fb.mode is ForwardMode.TARGET_VERIFY:
            return TritonStep(extend=self._graph_plan_verify(fb, capturing))
        if not fb.mode.is_decode or fb.custom_mask is not None:
            raise ValueError(f"the triton backend captures decode and verify batches only, got mode {fb.mode.value}")
        g = self._graph_state(fb, capturing)
        bs = fb.batch_size
        if capturing:
            g.splits_for_bs[bs] = max_splits_for_batch(bs, self._programs_per_split(), self.split_policy)
        elif bs not in g.splits_for_bs:
            raise ValueError(f"batch size {bs} was never captured (captured: {sorted(g.splits_for_bs)})")
        grid_splits = g.splits_for_bs[bs]
        meta = metadata_for_batch(fb, buffers=g.buffers)
        g.seq_lens[:bs].copy_(fb.seq_lens.to(torch.int32), non_blocking=True)
        splits = plan_kv_splits(fb.seq_lens_cpu, self._programs_per_split(), self.split_policy, grid_splits)
        g.num_splits[:bs].copy_(to_device(splits, self.pool.device, torch.int32))
        return TritonStep(decode=DecodeStep(meta, g.seq_lens[:bs], g.num_splits[:bs], grid_splits,
                                            write_final=grid_splits == 1, graph_bs=bs))

    def _graph_plan_verify(self, fb: ForwardBatch, capturing: bool) -> ExtendStep:
        """A verify step of q tokens per request: the paged extend kernel over fixed buffers.

        In graph planning `fb.custom_mask`, when set, is the tree's compact mask: bool `[bs, q, q]` (or that
        flattened) over each request's new tokens (True = may attend), the cached prefix visible to every row. The capture keeps its
        address (the runner's fixed buffer); a replay whose mask lives elsewhere is copied there.
        """
        g = self._graph_state(fb, capturing)
        bs = fb.batch_size
        q = fb.extend_lens_cpu[0]
        if any(e != q for e in fb.extend_lens_cpu):
            raise ValueError(f"a verify graph runs as many tokens for every request, got {fb.extend_lens_cpu}")
        tree = fb.custom_mask is not None
        if tree and fb.custom_mask.numel() != bs * q * q:
            raise ValueError(f"a verify graph's tree mask is [bs, q, q] = {bs * q * q} entries, got "
                             f"{fb.custom_mask.numel()}")
        key = (bs, q, tree)
        if capturing:
            mask = mask_indptr = None
            if tree:
                mask = fb.custom_mask.reshape(-1)
                mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
                mask_indptr = torch.arange(bs, dtype=torch.int64, device=self.pool.device) * (q * q)  # [bs]
            # MLA runs its tile kernel here: the decode-row plan is built per step on the host
            g.verify_steps[key] = ExtendStep(
                None, g.seq_lens[:bs], [0] * bs, [q] * bs, {}, mask, mask_indptr,
                mla_rows=(None, None, "CUDA graph"), verify=True, mask_new_keys_only=tree)
        elif key not in g.verify_steps:
            raise ValueError(f"verify batch (bs {bs}, {q} tokens each, {'tree' if tree else 'chain'}) was never "
                             f"captured (captured: {sorted(g.verify_steps)})")
        step = g.verify_steps[key]
        step.meta = metadata_for_batch(fb, buffers=g.buffers)
        g.seq_lens[:bs].copy_(fb.seq_lens.to(torch.int32), non_blocking=True)
        if tree and fb.custom_mask.data_ptr() != step.custom_mask.data_ptr():
            step.custom_mask.copy_(fb.custom_mask.reshape(-1), non_blocking=True)
        return step

    def _graph_partials(self, num_heads: int, v_dim: int, bs: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one flat float32 storage sized for the largest bs * splits of any capturable batch."""
        g = self._graph
        key = (num_heads, v_dim)
        if key not in g.partial_storage:
            # a tile's waves may be resolved after the first capture's grid was planned with the constructed
            # policy's: size for whichever gives more splits
            policy = dataclasses.replace(self.split_policy,
                                         waves=max(self.split_policy.waves, self._base_policy.waves))
            programs = self._graph_programs()
            most = max(b * max_splits_for_batch(b, programs, policy) for b in range(1, g.max_bs + 1))
            g.partial_storage[key] = (
                torch.empty(most * num_heads * v_dim, dtype=torch.float32, device=self.pool.device),
                torch.empty(most * num_heads, dtype=torch.float32, device=self.pool.device),
            )
        o_flat, lse_flat = g.partial_storage[key]
        n = bs * num_heads * splits
        return o_flat[: n * v_dim].view(bs, num_heads, splits, v_dim), lse_flat[:n].view(bs, num_heads, splits)

    def plan_for_capture(self, fb: ForwardBatch) -> TritonStep:
        return self._graph_plan(fb, capturing=True)

    def plan_for_replay(self, fb: ForwardBatch) -> TritonStep:
        return self._graph_plan(fb, capturing=False)
