"""fa4: FlashAttention 4 (`flash-attn-4`, CuTe DSL) behind the attnserve contract, for prefill and extend.

FA4's entry point is `flash_attn.cute.interface.flash_attn_varlen_func`. Two ways in:

- ragged: no request of the step has a cached prefix, so this step's q/k/v are the whole attention;
  they go in as packed rows with `cu_seqlens_q = cu_seqlens_k` (no read of the pool).
- paged: some request has a prefix. The pool's `[num_slots, kv_heads, d]` buffers are FA4's paged layout
  `[num_pages, page_size, kv_heads, d]` viewed without a copy; each request's page ids (`page_table`,
  `[B, pages]` int32) and its KV length (`seqused_k`) say what it reads. FA4 aligns the causal mask to
  the end of each request's KV, as extend needs (the new tokens are the last ones).

Page sizes: FA4 loads a KV tile with TMA when the page size equals its key tile (128 at head dim 128) and
gathers rows with cp.async otherwise, so every page size runs; 128 is the fast one, and selection prefers
it (`selection.PREFERRED_PAGE_SIZE`). FA4 refuses FP8 inputs on Hopper and wants K, V and q in one dtype,
so FP8 pools are refused here.

Decode is refused (features.decode False): FA4 has no split-KV on SM90, so one query per request over a
long context leaves most SMs idle, and SGLang also runs fa4 for prefill only. Selection pairs it with a
decode backend (the hybrid backend routes by forward mode). Custom masks (speculative verify), MLA pools
and attention sinks are refused too: FA4's masks are CuTe callables and its MLA path is Blackwell-only.

Head dims 64/96/128: the range FA4 runs on both SM90 and SM100 with `seqused_k` (SM100's 256-wide kernel
has no `seqused_k`). `flash_attn` is imported only when a backend object is built.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnserve._lazy import require
from attnserve.attention.base import AttentionBackend, BackendFeatures
from attnserve.batch import ForwardBatch

FA4_MODULE = "flash_attn.cute.interface"
FA4_DISTRIBUTION = "flash-attn-4"

FEATURES = BackendFeatures(
    kv_dtypes=frozenset({"bf16", "fp16"}),
    attention_types=frozenset({"MHA", "GQA"}),
    head_dims=(64, 96, 128),
    asymmetric_kv=True,  # V's width is read from V
    sliding_window=True,
    logit_softcap=True,
    decode=False,
    cuda_graph=False,  # decode graphs only; fa4 serves no decode
    devices=frozenset({"cuda"}),
    compute_capabilities=(9, 10),  # SM90 (Hopper), SM100/SM103 (Blackwell)
    required_packages=("flash_attn.cute",),
)


def fa4_varlen() -> Callable:
    """FA4's `flash_attn_varlen_func`, or MissingDependencyError naming the install command."""
    return require(FA4_MODULE, "the fa4 attention backend").flash_attn_varlen_func


@dataclass(frozen=True)
class PagedArgs:
    """What FA4 reads of the paged pool for one step."""

    page_table: torch.Tensor  # [B, max_pages] int32, page ids (0 past a request's length)
    seqused_k: torch.Tensor  # [B] int32, KV length of each request
    cu_seqlens_q: torch.Tensor  # [B+1] int32, query row offsets
    max_seqlen_q: int
    max_seqlen_k: int


def paged_args(fb: ForwardBatch, page_size: int) -> PagedArgs:
    """Page table and lengths from the batch's request -> slot rows (host lengths: no device sync).

    A page's id is the slot of its first token // page_size; the pool hands out whole pages, so every
    slot of a page belongs to it.
    """
    device = fb.req_to_token.device
    max_len = max(fb.seq_lens_cpu, default=0)
    pages = max(1, -(-max_len // page_size))
    rows = fb.req_to_token[fb.req_pool_indices.long(), : pages * page_size : page_size]  # [B, <= pages]
    table = torch.zeros(fb.batch_size, pages, dtype=torch.int32, device=device)  # [B, pages]
    table[:, : rows.shape[1]] = (rows // page_size).to(torch.int32)
    used_pages = torch.tensor([-(-s // page_size) for s in fb.seq_lens_cpu], device=device)  # [B]
    table = torch.where(torch.arange(pages, device=device)[None, :] < used_pages[:, None], table, 0)
    return PagedArgs(table.contiguous(), fb.seq_lens.to(device=device, dtype=torch.int32).contiguous(),
                     cu_seqlens(fb.extend_lens_cpu, device), max(fb.extend_lens_cpu, default=0), max_len)


def cu_seqlens(lens: list[int], device) -> torch.Tensor:
    """[B+1] int32 offsets of packed rows, built on the host."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def window_of(layer) -> tuple[int | None, int | None]:
    """FA4's (left, right) window: ours counts the query itself, FA4's left does not; causal fixes right at 0."""
    return (None, None) if layer.sliding_window is None else (layer.sliding_window - 1, 0)


_ACCEPTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> its keyword names (None: any)


def _accepted(fn: Callable) -> frozenset[str] | None:
    """The keywords `fn` takes, read once per function (None: it takes **kwargs or has no signature)."""
    try:
        return _ACCEPTED[fn]
    except (KeyError, TypeError):  # not seen yet, or not weakly referable (then read every time)
        pass
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a compiled callable without a signature: pass everything
        params = None
    names = None if params is None or any(p.kind is p.VAR_KEYWORD for p in params.values()) else frozenset(params)
    try:
        _ACCEPTED[fn] = names
    except TypeError:
        pass
    return names


def call_varlen(fn: Callable, q, k, v, **kwargs) -> torch.Tensor:
    """Call FA4's varlen function with the keywords it takes; the output `[T, Hq, Dv]`.

    FA4 is a beta whose keyword list grows between releases; an argument this one lacks is fatal only
    when it carries a value (a missing `page_table` is, a missing unused `window_size` is not).
    """
    accepted = _accepted(fn)
    if accepted is not None:
        missing = [name for name, val in kwargs.items() if name not in accepted and not _unset(val)]
        if missing:
            raise RuntimeError(f"this {FA4_DISTRIBUTION} has no {', '.join(missing)} argument")
        kwargs = {name: val for name, val in kwargs.items() if name in accepted}
    out = fn(q, k, v, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _unset(val) -> bool:
    """A keyword left at FA4's default: None, a (None, None) window, a 0.0 soft-cap."""
    if val is None:
        return True
    if isinstance(val, tuple):
        return all(x is None for x in val)
    return isinstance(val, float) and val == 0.0


@dataclass
class FA4Step:
    """What plan() built for one step: fresh prompts run ragged over cu_seqlens, others paged."""

    extend_path: str  # which of FA4's entries the step runs, as the kernel race reports it
    cu_seqlens: torch.Tensor | None = None  # [B+1] int32, fresh prompts
    paged: PagedArgs | None = None  # a step with a prefix


class FA4Backend(AttentionBackend):
    """FlashAttention 4 over an MHA/GQA pool: ragged prefill, paged extend; no decode."""

    name = "fa4"
    features = FEATURES

    def __init__(self, pool, **options):
        super().__init__(pool, **options)
        if pool.is_mla:
            raise ValueError("fa4 serves MHA/GQA pools; an MLA pool takes triton or flashinfer")
        if pool.is_fp8:
            raise ValueError("fa4 reads bf16/fp16 KV only (FA4 takes q, K and V in one dtype, no FP8 on SM90)")
        self._fa4 = fa4_varlen()

    def plan(self, fb: ForwardBatch) -> FA4Step:
        """Lengths and, when a request has a prefix, the page table: once per step, on the host's lengths."""
        if fb.custom_mask is not None:
            raise ValueError("fa4 has no custom attention masks (speculative verify): use flashinfer or triton")
        if not any(fb.prefix_lens_cpu):
            return FA4Step("ragged (fresh prompts)", cu_seqlens=cu_seqlens(fb.extend_lens_cpu, fb.req_to_token.device))
        return FA4Step(f"paged (page size {self.pool.page_size})", paged=paged_args(fb, self.pool.page_size))

    def _common(self, layer) -> dict:
        if layer.sinks is not None:
            raise ValueError("fa4 runs no attention sinks here")
        return {"softmax_scale": float(layer.scaling), "causal": True, "window_size": window_of(layer),
                "softcap": float(layer.logit_cap) if layer.logit_cap is not None else 0.0}

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch, meta: FA4Step) -> torch.Tensor:
        if meta.cu_seqlens is not None and k is not None and v is not None:
            n = max(fb.extend_lens_cpu, default=0)
            return call_varlen(self._fa4, q, k.to(q.dtype), v.to(q.dtype), cu_seqlens_q=meta.cu_seqlens,
                               cu_seqlens_k=meta.cu_seqlens, max_seqlen_q=n, max_seqlen_k=n, **self._common(layer))
        pa = meta.paged or paged_args(fb, self.pool.page_size)
        pool, lid, ps = self.pool, layer.layer_id, self.pool.page_size
        kb, vb = pool.get_key_buffer(lid), pool.get_value_buffer(lid)  # [num_slots, Hkv, D], [num_slots, Hkv, Dv]
        k_cache = kb.view(pool.num_pages, ps, kb.shape[1], kb.shape[2])  # [num_pages, page_size, Hkv, D]
        v_cache = vb.view(pool.num_pages, ps, vb.shape[1], vb.shape[2])  # [num_pages, page_size, Hkv, Dv]
        return call_varlen(self._fa4, q, k_cache, v_cache, cu_seqlens_q=pa.cu_seqlens_q, seqused_k=pa.seqused_k,
                           max_seqlen_q=pa.max_seqlen_q, max_seqlen_k=pa.max_seqlen_k, page_table=pa.page_table,
                           **self._common(layer))  # [T, Hq, Dv]

    def forward_decode(self, q, layer, fb: ForwardBatch, meta: FA4Step) -> torch.Tensor:
        raise NotImplementedError("fa4 serves prefill and extend only (no split-KV decode on SM90); "
                                  "name a decode backend, e.g. --decode-attention-backend triton")


__all__ = [
    "FA4_DISTRIBUTION",
    "FA4_MODULE",
    "FEATURES",
    "FA4Backend",
    "FA4Step",
    "PagedArgs",
    "call_varlen",
    "cu_seqlens",
    "fa4_varlen",
    "paged_args",
    "window_of",
]
