"""Contestants of the kernel race: a paged batch for a workload, and one callable per backend.

Every callable computes the same attention over the same pool; host-side planning
happens once before timing (as plan() does once per step in the engine), so only
the per-layer work is timed. FlashInfer, FA4 and SDPA (its flash and cuDNN kernels) are
called directly, the way a peer is measured, not through attnserve's wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnserve.attention.layer import AttentionLayer
from attnserve.attention.metadata import metadata_for_batch
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.bench.workloads import Workload
from attnserve.choice.registry import get_spec
from attnserve.kvcache.pool import KVPool, MHAKVPool, MLAKVPool


@dataclass
class RaceBatch:
    workload: Workload
    fb: ForwardBatch
    layer: AttentionLayer
    pool: KVPool
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] this step's keys (also in the pool); MLA: the latent rows [T, 1, rank + rope]
    v: torch.Tensor | None  # [T, Hkv, D]; None for MLA
    keep: list = field(default_factory=list)  # objects a callable needs alive (wrappers, workspaces)


def build_race_batch(w: Workload, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                     dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0) -> RaceBatch:
    """Random pool contents, pages handed out in shuffled order, every request `w.seq_len` long."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ps = w.page_size
    pages_per_req = -(-w.seq_len // ps)
    num_pages = w.batch * pages_per_req + 1  # page 0 stays the padding page
    if w.mla is not None:
        pool = MLAKVPool(num_pages, ps, 1, w.mla.kv_lora_rank, w.mla.rope_dim, dtype=dtype, device=device)
        pool.kv_buffer[0].normal_(generator=gen)
        num_heads, num_kv_heads, head_dim = w.mla.num_heads, 1, w.mla.width
    else:
        pool = MHAKVPool(num_pages, ps, 1, num_kv_heads, head_dim, dtype=dtype, device=device)
        pool.k_buffer[0].normal_(generator=gen)
        pool.v_buffer[0].normal_(generator=gen)
    pages = (torch.randperm(num_pages - 1, generator=gen, device=device) + 1).view(w.batch, pages_per_req)
    slots = pages[:, :, None] * ps + torch.arange(ps, device=device)  # [B, pages, ps]
    req_to_token = slots.reshape(w.batch, -1)[:, : w.seq_len].to(torch.int32).contiguous()  # [B, seq]
    mode = ForwardMode.DECODE if w.kind == "decode" else ForwardMode.EXTEND
    fb = ForwardBatch.from_lengths(mode, list(range(w.batch)), [w.prefix] * w.batch, [w.new_tokens] * w.batch,
                                   req_to_token, pool)
    t = fb.num_tokens
    q = torch.randn(t, num_heads, head_dim, generator=gen, device=device, dtype=dtype)  # [T, Hq, D]
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)  # [T, Hkv, D]
    if w.mla is not None:
        layer = AttentionLayer(0, num_heads, 1, head_dim, scaling=w.mla.qk_head_dim**-0.5,
                               v_head_dim=w.mla.kv_lora_rank, is_mla=True).to(device)
        v = None
        pool.store(0, fb.out_cache_loc, k)
    else:
        layer = AttentionLayer(0, num_heads, num_kv_heads, head_dim).to(device)
        v = torch.randn(t, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)  # [T, Hkv, D]
        pool.store(0, fb.out_cache_loc, k, v)
    return RaceBatch(w, fb, layer, pool, q, k, v)


# ---- attnserve backends through the contract ---------------------------------------------------------
def attnserve_racer(name: str, rb: RaceBatch, **options) -> Callable[[], torch.Tensor]:
    backend = get_spec(name).build(rb.pool, **options)
    meta = backend.plan(rb.fb)
    rb.keep.append(backend)
    if rb.workload.kind == "decode":
        call = lambda: backend.forward_decode(rb.q, rb.layer, rb.fb, meta)
    else:
        call = lambda: backend.forward_extend(rb.q, rb.k, rb.v, rb.layer, rb.fb, meta)
    call.step = meta  # the race reports which of its kernels ran (the step's extend_path)
    return call


# ---- FlashInfer, called directly -----------------------------------------------------------------
def _flashinfer():
    """FlashInfer, an optional package: imported only when a FlashInfer racer is built."""
    import flashinfer

    return flashinfer


def _workspace(rb: RaceBatch) -> torch.Tensor:
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=rb.q.device)  # [256 MiB]
    rb.keep.append(ws)
    return ws


def _paged_cache(rb: RaceBatch):
    p = rb.pool
    shape = (p.num_pages, p.page_size, p.num_kv_heads, p.head_dim)
    return p.k_buffer[0].view(shape), p.v_buffer[0].view(shape)


def _run_over_pool(rb: RaceBatch, wrapper) -> Callable[[], torch.Tensor]:
    """A planned paged wrapper, run on the pool's K and V as FlashInfer's NHD page layout."""
    rb.keep.append(wrapper)
    cache = _paged_cache(rb)
    return lambda: wrapper.run(rb.q, cache)


def flashinfer_decode_racer(rb: RaceBatch, tensor_cores: bool) -> Callable[[], torch.Tensor]:
    flashinfer = _flashinfer()
    m = metadata_for_batch(rb.fb)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(rb), "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(m.kv_indptr, m.kv_indices, m.kv_last_page_len, rb.layer.num_heads, rb.layer.num_kv_heads,
                 rb.layer.head_dim, m.page_size, sm_scale=rb.layer.scaling, q_data_type=rb.q.dtype,
                 kv_data_type=rb.pool.dtype)
    return _run_over_pool(rb, wrapper)


def flashinfer_prefill_racer(rb: RaceBatch, kernel: str) -> Callable[[], torch.Tensor]:
    """Fresh prompts: the ragged wrapper over this step's q/k/v. With a prefix: the paged wrapper over the pool."""
    flashinfer = _flashinfer()
    m = metadata_for_batch(rb.fb)
    lay = rb.layer
    if rb.workload.prefix == 0:
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(rb), "NHD", backend=kernel)
        wrapper.plan(m.qo_indptr, m.qo_indptr, lay.num_heads, lay.num_kv_heads, lay.head_dim, causal=True,
                     sm_scale=lay.scaling, q_data_type=rb.q.dtype, kv_data_type=rb.k.dtype)
        rb.keep.append(wrapper)
        return lambda: wrapper.run(rb.q, rb.k, rb.v)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(rb), "NHD", backend=kernel)
    wrapper.plan(m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len, lay.num_heads, lay.num_kv_heads,
                 lay.head_dim, m.page_size, causal=True, sm_scale=lay.scaling, q_data_type=rb.q.dtype,
                 kv_data_type=rb.pool.dtype)
    return _run_over_pool(rb, wrapper)


def flashinfer_mla_racer(rb: RaceBatch, kernel: str) -> Callable[[], torch.Tensor]:
    """BatchMLAPagedAttentionWrapper over the latent pool (ckv / kpe are views of its rows)."""
    flashinfer = _flashinfer()
    m = metadata_for_batch(rb.fb)
    p, lay = rb.pool, rb.layer
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(rb), backend=kernel)
    wrapper.plan(m.qo_indptr, m.kv_indptr, m.kv_indices, rb.fb.seq_lens.to(torch.int32), lay.num_heads,
                 p.kv_lora_rank, p.qk_rope_head_dim, m.page_size, rb.workload.kind != "decode", lay.scaling,
                 rb.q.dtype, p.dtype)
    rb.keep.append(wrapper)
    rows = p.kv_buffer[0].view(p.num_pages, p.page_size, p.head_dim)
    ckv, kpe = rows[..., : p.kv_lora_rank], rows[..., p.kv_lora_rank :]
    q_nope, q_pe = rb.q[..., : p.kv_lora_rank], rb.q[..., p.kv_lora_rank :]
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe)


# ---- FA4, called directly -----------------------------------------------------------------------
def fa4_racer(rb: RaceBatch) -> Callable[[], torch.Tensor]:
    """FA4's `flash_attn_varlen_func`: fresh prompts as packed rows (cu_seqlens for q and k), a chunk over a
    cached prefix through `page_table` into the pool. The race's pools have the workload's page size (1 for
    the MHA prefill and extend rows), where FA4 gathers rows with cp.async; page 128 would take its TMA path."""
    from attnserve.attention.backends.fa4 import call_varlen, cu_seqlens, fa4_varlen, paged_args

    fa4 = fa4_varlen()
    w, lay = rb.workload, rb.layer
    common = {"softmax_scale": float(lay.scaling), "causal": True}
    if w.prefix == 0:
        cu = cu_seqlens(rb.fb.extend_lens_cpu, rb.q.device)  # [B+1]
        rb.keep.append(cu)
        n = w.new_tokens
        return lambda: call_varlen(fa4, rb.q, rb.k, rb.v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                   max_seqlen_k=n, **common)
    pa = paged_args(rb.fb, rb.pool.page_size)
    rb.keep.append(pa)
    k_cache, v_cache = _paged_cache(rb)
    return lambda: call_varlen(fa4, rb.q, k_cache, v_cache, cu_seqlens_q=pa.cu_seqlens_q, seqused_k=pa.seqused_k,
                               max_seqlen_q=pa.max_seqlen_q, max_seqlen_k=pa.max_seqlen_k,
                               page_table=pa.page_table, **common)


# ---- torch SDPA (fresh prompts of equal length only) ----------------------------------------------
def sdpa_racer(rb: RaceBatch, kernel: str) -> Callable[[], torch.Tensor]:
    """`kernel` is "cudnn" or "flash". Layout changes and GQA expansion happen before timing."""
    w, lay = rb.workload, rb.layer
    if w.prefix != 0:
        raise ValueError("SDPA races fresh prompts only")
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kernel]
    b, t = w.batch, w.new_tokens
    q = rb.q.view(b, t, lay.num_heads, lay.head_dim).transpose(1, 2).contiguous()  # [B, Hq, T, D]
    k = rb.k.view(b, t, lay.num_kv_heads, lay.head_dim).transpose(1, 2)
    v = rb.v.view(b, t, lay.num_kv_heads, lay.head_dim).transpose(1, 2)
    k = k.repeat_interleave(lay.gqa_group, dim=1).contiguous()  # [B, Hq, T, D]
    v = v.repeat_interleave(lay.gqa_group, dim=1).contiguous()  # [B, Hq, T, D]
    rb.keep += [q, k, v]

    def run():
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=lay.scaling)

    return run


# ---- the field -------------------------------------------------------------------------------------
def racers_for(rb: RaceBatch, wanted: list[str] | None, triton_options: dict | None = None) -> dict[str, Callable]:
    """Name -> factory for every contestant that applies to this workload (built lazily by the caller)."""
    w = rb.workload
    field_: dict[str, Callable] = {"triton": lambda: attnserve_racer("triton", rb, **(triton_options or {}))}
    if w.mla is not None:
        field_["flashinfer-mla-fa3"] = lambda: flashinfer_mla_racer(rb, "fa3")
        field_["flashinfer-mla-fa2"] = lambda: flashinfer_mla_racer(rb, "fa2")
    elif w.kind == "decode":
        field_["flashinfer"] = lambda: flashinfer_decode_racer(rb, tensor_cores=True)
        field_["flashinfer-cuda-cores"] = lambda: flashinfer_decode_racer(rb, tensor_cores=False)
    else:
        field_["flashinfer-fa3"] = lambda: flashinfer_prefill_racer(rb, "fa3")
        field_["flashinfer-fa2"] = lambda: flashinfer_prefill_racer(rb, "fa2")
        field_["fa4"] = lambda: fa4_racer(rb)
        if w.prefix == 0:
            field_["sdpa-cudnn"] = lambda: sdpa_racer(rb, "cudnn")
            field_["sdpa-flash"] = lambda: sdpa_racer(rb, "flash")
    field_["torch_native"] = lambda: attnserve_racer("torch_native", rb)
    if wanted:
        field_ = {k: f for k, f in field_.items() if any(k == x or (x.endswith("*") and k.startswith(x[:-1]))
                                                         for x in wanted)}
    return field_


def output_rows(out: torch.Tensor, rb: RaceBatch) -> torch.Tensor:
    """Any contestant's output as `[T, Hq, Dv]` (SDPA returns `[B, Hq, T, Dv]`)."""
    if out.dim() == 4:
        return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[-1])
    return out
