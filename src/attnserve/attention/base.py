"""The backend contract: features, requirements, the ABC (the step it plans from is attnserve.batch).

Every backend keeps the same shape of work: `meta = plan(fb)` once per step,
outside any CUDA graph, then `forward(q, k, v, layer, fb, meta)` for every layer.
What plan() builds is returned as a value (vLLM's metadata builder), never kept
on the backend, so a backend holds only what outlives a step (kernel choices per
layer signature, graph buffers, FlashInfer's wrappers, caches of K/V). Features
are data so that selection and validation can reason about a backend without
instantiating it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from attnserve.batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from attnserve.kvcache.pool import KVPool


# What a backend's plan(fb) returns for one step: its own dataclass (CSR metadata, split plans, masks), read by
# the same backend's forward calls of that step and by nobody else.
StepMetadata = Any

ALL_KV_DTYPES = frozenset({"bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"})


@dataclass(frozen=True)
class BackendFeatures:
    """What a backend can do, as data. Selection and validation read only this."""

    page_sizes: tuple[int, ...] | None = None  # None: any power of two
    kv_dtypes: frozenset[str] = frozenset({"bf16", "fp16", "fp32"})
    attention_types: frozenset[str] = frozenset({"MHA", "GQA"})  # subset of MHA, GQA, MLA
    head_dims: tuple[int, ...] | None = None  # None: any
    asymmetric_kv: bool = False  # K and V head widths may differ (besides MLA's own layout)
    sliding_window: bool = False
    attention_sinks: bool = False
    logit_softcap: bool = False
    custom_mask: bool = False  # arbitrary per-request masks (speculative verify)
    spec_topk1: bool = False  # speculative decoding with one draft chain
    spec_topk_gt1: bool = False  # tree speculative decoding (topk > 1)
    spec_topk_gt1_paged: bool = False  # topk > 1 together with page size > 1
    cuda_graph: bool = False
    prefill: bool = True
    decode: bool = True
    deterministic: bool = False
    expanded_mla_prefill: bool = False  # fresh MLA prompts over K/V expanded per head (forward_expanded_prefill)
    devices: frozenset[str] = frozenset({"cuda"})  # cpu, cuda, rocm, mps, xpu, npu
    compute_capabilities: tuple[int, ...] | None = None  # allowed major versions (9 = Hopper); None: any
    min_compute_capability: tuple[int, int] | None = None
    required_packages: tuple[str, ...] = ()
    implemented: bool = True  # False: a known SGLang backend attnserve has no implementation of


# Feature groups several backends declare whole, spelled once: every speculative verify shape (a chain; trees,
# contiguous or paged; each through a custom mask), and every per-layer variant a model may ask for.
EVERY_VERIFY_SHAPE = {"custom_mask": True, "spec_topk1": True, "spec_topk_gt1": True, "spec_topk_gt1_paged": True}
EVERY_LAYER_VARIANT = {"sliding_window": True, "attention_sinks": True, "logit_softcap": True}


@dataclass(frozen=True)
class AttentionRequirements:
    """What a model plus the serving flags ask of a backend (one side of a compatibility check)."""

    attention_type: str = "GQA"  # MHA, GQA or MLA
    head_dim: int = 128
    v_head_dim: int | None = None
    page_size: int = 1
    kv_dtype: str = "bf16"
    sliding_window: bool = False
    attention_sinks: bool = False
    logit_softcap: bool = False
    custom_mask: bool = False
    spec_topk: int = 0  # 0: no speculative decoding
    needs_prefill: bool = True
    needs_decode: bool = True


def unsupported(features: BackendFeatures, req: AttentionRequirements) -> list[str]:
    """Reasons a backend with `features` cannot serve `req` (empty when it can)."""
    why = []
    f = features
    if req.attention_type not in f.attention_types:
        why.append(f"no {req.attention_type} attention (supports {'/'.join(sorted(f.attention_types))})")
    if f.page_sizes is not None and req.page_size not in f.page_sizes:
        why.append(f"page size {req.page_size} unsupported (needs {'/'.join(map(str, f.page_sizes))})")
    if req.kv_dtype not in f.kv_dtypes:
        why.append(f"KV dtype {req.kv_dtype} unsupported (supports {', '.join(sorted(f.kv_dtypes))})")
    if f.head_dims is not None and req.attention_type != "MLA" and req.head_dim not in f.head_dims:
        why.append(f"head_dim {req.head_dim} unsupported (supports {f.head_dims})")
    if (
        req.attention_type != "MLA"
        and req.v_head_dim is not None
        and req.v_head_dim != req.head_dim
        and not f.asymmetric_kv
    ):
        why.append(f"K/V head widths differ ({req.head_dim}/{req.v_head_dim})")
    for flag, name in (
        ("sliding_window", "sliding-window attention"),
        ("attention_sinks", "attention sinks"),
        ("logit_softcap", "logit soft-capping"),
        ("custom_mask", "custom attention masks"),
    ):
        if getattr(req, flag) and not getattr(f, flag):
            why.append(f"no {name}")
    if req.spec_topk == 1 and not f.spec_topk1:
        why.append("no speculative decoding")
    if req.spec_topk > 1:
        if not f.spec_topk_gt1:
            why.append(f"no speculative topk > 1 (got {req.spec_topk})")
        elif req.page_size > 1 and not f.spec_topk_gt1_paged:
            why.append(f"speculative topk > 1 with page size {req.page_size} unsupported")
    if req.needs_prefill and not f.prefill:
        why.append("decode only")
    if req.needs_decode and not f.decode:
        why.append("prefill only")
    return why


@runtime_checkable
class AttentionLayerParams(Protocol):
    """What a backend reads of the layer it serves (`attention.layer.AttentionLayer` is the one kind).

    The contract names only these attributes, so this module never imports the layer module
    (which imports this one for the backend it calls).
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # K width per head (MLA: the latent row, kv_lora_rank + rope dim)
    v_head_dim: int
    scaling: float
    sliding_window: int | None  # a query at p sees keys > p - sliding_window; None: full attention
    logit_cap: float | None  # scores -> cap * tanh(scores / cap)
    sinks: torch.Tensor | None  # [num_heads] logits joining every softmax denominator
    is_mla: bool

    @property
    def gqa_group(self) -> int: ...


class RopeForStore(Protocol):
    """What `rotate_and_store_kv` needs of a step's rotary embedding (`models.rope.RopeStep` is the one kind)."""

    fused_store: object | None  # a kernel that rotates and writes the pool in one pass, or None

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotate_and_store(self, q, k, v, k_buffer, v_buffer, loc) -> tuple[torch.Tensor, torch.Tensor]: ...


class AttentionBackend(ABC):
    """Attention over the paged pool. Subclasses fill `name`, `features` and the two forward paths."""

    name: ClassVar[str] = "abstract"
    features: ClassVar[BackendFeatures] = BackendFeatures()

    def __init__(self, pool: KVPool, **options):
        self.pool = pool
        self.options = options
        self.graph_max_bs = 0

    # ---- per step -------------------------------------------------------------------------
    @abstractmethod
    def plan(self, fb: ForwardBatch) -> StepMetadata:
        """This step's metadata, built once before the layers run. Host-side, never inside a graph."""

    def store_kv(self, layer: AttentionLayerParams, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Write this step's K/V at `fb.out_cache_loc`. Backends with their own store kernel override it."""
        self.pool.store(layer.layer_id, fb.out_cache_loc, k, v)

    def rotate_and_store_kv(
        self, layer: AttentionLayerParams, fb: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rope: RopeForStore,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply RoPE to q and k, write this step's K/V at `fb.out_cache_loc`; returns the rotated (q, k).

        `rope` is the model's RopeStep. The pool's layout is every backend's layout, so when the model
        offers a fused rotate+store kernel (`rope.fused_store`) and the pool stores K/V as they are (MHA,
        not FP8: scaled formats keep one quantising store), one pass does both. Otherwise q and k are
        rotated and `store_kv` writes them. A backend whose store differs overrides both methods.
        """
        if rope.fused_store is not None and v is not None and not self.pool.is_mla and not self.pool.is_fp8:
            lid = layer.layer_id
            return rope.rotate_and_store(q, k, v, self.pool.get_key_buffer(lid), self.pool.get_value_buffer(lid),
                                         fb.out_cache_loc)
        q, k = rope.rotate(q, k)
        self.store_kv(layer, fb, k, v)
        return q, k

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayerParams,
        fb: ForwardBatch, meta: StepMetadata,
    ) -> torch.Tensor:
        """q `[tokens, heads_q, head_dim]` -> o `[tokens, heads_q, v_head_dim]`; meta is what plan(fb) returned."""
        if fb.mode is ForwardMode.IDLE or q.shape[0] == 0:
            return q.new_empty(q.shape[0], q.shape[1], layer.v_head_dim)
        if fb.mode.is_decode:
            return self.forward_decode(q, layer, fb, meta)
        return self.forward_extend(q, k, v, layer, fb, meta)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayerParams,
        fb: ForwardBatch, meta: StepMetadata,
    ) -> torch.Tensor:
        """Prefill / chunked prefill / verify: new tokens attend to the cached prefix and, causally, each other.

        k and v are this step's new K/V (already in the pool); backends may read them directly
        instead of through the page table.
        """

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayerParams, fb: ForwardBatch, meta: StepMetadata
    ) -> torch.Tensor:
        """One query token per request against its whole KV."""

    # ---- expanded MLA prefill (declared by `features.expanded_mla_prefill`) ---------------------
    def expanded_prefill_applies(self, fb: ForwardBatch, meta: StepMetadata) -> bool:
        """Whether this planned step may run MLA attention over K/V expanded per head.

        Only a backend that declares `features.expanded_mla_prefill` is asked (`AttentionLayer` checks
        the flag first); it answers for the step `plan(fb)` described (typically: fresh prompts only).
        """
        return False

    def forward_expanded_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerParams, fb: ForwardBatch,
        meta: StepMetadata,
    ) -> torch.Tensor:
        """MLA prefill with the latent expanded per head: q, k `[T, H, nope + rope]`, v `[T, H, v]` -> `[T, H, v]`.

        The latent rows are already in the pool for the steps that follow; this attends over this
        step's expanded K/V, causally within each request.
        """
        raise NotImplementedError(f"backend {self.name} has no expanded MLA prefill")

    # ---- CUDA graphs ------------------------------------------------------------------------
    def init_graph_buffers(self, max_bs: int, max_tokens: int) -> None:
        """Allocate fixed-address buffers sized for the largest captured batch."""
        raise NotImplementedError(f"backend {self.name} does not support CUDA graphs")

    def plan_for_capture(self, fb: ForwardBatch) -> StepMetadata:
        """Fill the fixed buffers' first rows for capture (the graph records their addresses); the step's
        metadata over those buffers, for the captured forward calls."""
        raise NotImplementedError(f"backend {self.name} does not support CUDA graphs")

    def plan_for_replay(self, fb: ForwardBatch) -> StepMetadata:
        """Rewrite the fixed buffers in place for this step's (padded) batch before replay; the step's
        metadata over them (a replay reads only the buffers)."""
        raise NotImplementedError(f"backend {self.name} does not support CUDA graphs")
