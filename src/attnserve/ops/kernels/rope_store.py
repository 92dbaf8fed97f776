"""RoPE on q and k fused with the store of k and v into the paged KV pool.

Unfused, a layer rotates q and k (a dozen elementwise launches: slice, multiply,
subtract, concatenate) and then a store kernel reads k and v again to scatter
them to their slots. Here one program per token reads q, k and v once, writes the
rotated q and k (the attention backend reads them next) and writes the rotated k
and v to the pool at `loc[token]`, in the pool's layout `[slots, kv_heads, dim]`.

Pairs rotate in float32: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with x1
channel i and x2 channel i + rotary_dim/2 (HF/NeoX layout) or channels 2i and 2i+1
(interleaved, DeepSeek layout). Channels past rotary_dim pass through. Pools that
store a scaled format (FP8) are not handled here: they keep the unfused path, so
quantisation lives in one kernel (attention/kernels/store.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import next_pow2
from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor


@triton.jit
def _rotate_heads(
    X, stride_xh, Out, stride_oh, Buf, stride_bh, cos, sin, i1, i2, pair_mask,
    H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_PASS: tl.constexpr,
    TO_POOL: tl.constexpr,
):
    """Rotate the H heads of one token at X into Out (and the pool row at Buf when TO_POOL)."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < H)[:, None] & pair_mask[None, :]
    x1 = tl.load(X + h[:, None] * stride_xh + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + h[:, None] * stride_xh + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(Out.dtype.element_ty)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(Out.dtype.element_ty)
    tl.store(Out + h[:, None] * stride_oh + i1[None, :], o1, mask=mask)
    tl.store(Out + h[:, None] * stride_oh + i2[None, :], o2, mask=mask)
    if TO_POOL:
        tl.store(Buf + h[:, None] * stride_bh + i1[None, :], o1.to(Buf.dtype.element_ty), mask=mask)
        tl.store(Buf + h[:, None] * stride_bh + i2[None, :], o2.to(Buf.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:  # channels past the rotary dimension are copied as they are
        p = R + tl.arange(0, BLOCK_PASS)
        pmask = (h < H)[:, None] & (p < D)[None, :]
        xp = tl.load(X + h[:, None] * stride_xh + p[None, :], mask=pmask, other=0.0).to(Out.dtype.element_ty)
        tl.store(Out + h[:, None] * stride_oh + p[None, :], xp, mask=pmask)
        if TO_POOL:
            tl.store(Buf + h[:, None] * stride_bh + p[None, :], xp.to(Buf.dtype.element_ty), mask=pmask)


@triton.jit
def _rope_store_kernel(
    Q, K, V, Cos, Sin, Q_out, K_out, K_buf, V_buf, loc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    HQ: tl.constexpr, HK: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    D: tl.constexpr, R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    pair_mask = i < R // 2
    if INTERLEAVED:
        i1, i2 = 2 * i, 2 * i + 1
    else:
        i1, i2 = i, i + R // 2
    cos = tl.load(Cos + t * stride_ct + i, mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t * stride_st + i, mask=pair_mask, other=0.0).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, stride_qh, Q_out + t * stride_qot, stride_qoh, K_buf, 0, cos, sin,
                  i1, i2, pair_mask, HQ, BLOCK_HQ, D, R, BLOCK_PASS, False)
    _rotate_heads(K + t * stride_kt, stride_kh, K_out + t * stride_kot, stride_koh, K_buf + slot * stride_kbt,
                  stride_kbh, cos, sin, i1, i2, pair_mask, HK, BLOCK_HK, D, R, BLOCK_PASS, True)
    h = tl.arange(0, BLOCK_HK)
    dv = tl.arange(0, BLOCK_DV)
    vmask = (h < HK)[:, None] & (dv < DV)[None, :]
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=vmask, other=0.0)
    tl.store(V_buf + slot * stride_vbt + h[:, None] * stride_vbh + dv[None, :], v.to(V_buf.dtype.element_ty),
             mask=vmask)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    interleaved: bool = False,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` by cos/sin `[T, R/2]`; store k and v `[T, Hk, Dv]` at loc `[T]`.

    Returns the rotated (q, k), contiguous. Token and head strides of q/k/v are free (views into a
    fused qkv projection); the last dimension must be contiguous. No device sync: slots are trusted
    to be in range (they come from the allocator).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    tokens, hq, d = q.shape
    hk, dv = k.shape[1], v.shape[2]
    if k.shape != (tokens, hk, d) or v.shape[:2] != (tokens, hk):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if tuple(k_buffer.shape[1:]) != (hk, d) or tuple(v_buffer.shape[1:]) != (hk, dv):
        raise ValueError(f"pool buffers {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)} do not hold "
                         f"[slots, {hk}, {d}] / [slots, {hk}, {dv}]")
    half = cos.shape[-1]
    if cos.shape != (tokens, half) or sin.shape != cos.shape or not 0 < 2 * half <= d:
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} must be [{tokens}, rotary_dim/2] "
                         f"with rotary_dim <= head_dim {d}")
    if loc.shape != (tokens,):
        raise ValueError(f"out_cache_loc has shape {tuple(loc.shape)} but q has {tokens} tokens")
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    q_out = torch.empty(tokens, hq, d, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    k_out = torch.empty(tokens, hk, d, dtype=k.dtype, device=k.device)  # [T, Hk, D]
    if tokens == 0:
        return q_out, k_out
    rot = 2 * half
    _rope_store_kernel[(tokens,)](
        q, k, v, cos, sin, q_out, k_out, k_buffer, v_buffer, loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        HQ=hq, HK=hk, BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk), D=d, R=rot, BLOCK_HALF=next_pow2(half),
        BLOCK_PASS=next_pow2(d - rot) if d > rot else 0, DV=dv, BLOCK_DV=next_pow2(dv),
        INTERLEAVED=interleaved, num_warps=4, **launch_options(pdl),
    )
    return q_out, k_out
