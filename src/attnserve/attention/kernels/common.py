"""Pieces every attnserve Triton kernel shares: interpreter detection, the score transform, the online softmax.

Scores are kept in base 2 (scaled by log2(e)) so the kernels use exp2. Every kernel (MHA decode,
extend, MLA decode) turns a raw q.k^T tile into probabilities through `online_softmax_tile`, so the
scaling, soft-cap and running max/sum update are written once; the paged MHA kernels take a layer's
scales and masking features as `layer_scalars` and `layer_constexprs` give them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)  # the same constant, readable inside @triton.jit functions


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests); the kernels then avoid what the interpreter gets wrong.

    Triton 3.6's interpreter reads bf16 bits as another type inside tl.dot and rounds
    float->fp8 conversions wrongly near a binade's top, so kernels take a float32 dot
    and pre-round fp8 values when this is True.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_dtype_is_f32(*tensors: torch.Tensor) -> bool:
    """The tl.dot inputs must be float32: under the interpreter, or when any input is float32."""
    return interpreting() or any(t.dtype == torch.float32 for t in tensors)


def layer_scalars(layer) -> tuple[float, float, float, float, int]:
    """A LayerParams as the paged MHA kernels take it: (qk_scale_log2, sm_scale_k, v_scale, softcap, window).
    The pool's K scale folds into the softmax scale; 1.0 and 0 stand in for no soft cap and no window, which
    the HAS_SOFTCAP / HAS_WINDOW constexprs (`layer_constexprs`) switch off."""
    sm_scale_k = layer.sm_scale * layer.k_scale
    return sm_scale_k * LOG2E, sm_scale_k, layer.v_scale, float(layer.logit_cap or 1.0), int(layer.sliding_window or 0)


def layer_constexprs(layer, head_dim: int, v_dim: int) -> dict:
    """The paged MHA kernels' constexprs of a layer: its K and V widths padded to powers of two for tl.arange,
    and its masking features."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), V_DIM=v_dim, BLOCK_DV=next_pow2(v_dim),
                HAS_WINDOW=layer.sliding_window is not None, HAS_SOFTCAP=layer.logit_cap is not None,
                HAS_SINKS=layer.sinks is not None)


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap), written with exp so the interpreter and every GPU accept it."""
    x = tl.minimum(tl.maximum(scores / cap, -20.0), 20.0)  # tanh is +-1 in float32 beyond 9
    # tanh(x) = 1 - 2 / (exp(2x) + 1); exact at both tails (exp overflow gives 1, underflow -1)
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def to_log2(x):
    """A natural-log logit (e.g. an attention sink) in the kernels' base-2 units."""
    return x.to(tl.float32) * _LOG2E


@triton.jit
def dot_qk(q, k, DOT_F32: tl.constexpr):
    """q `[M, D]` . k `[N, D]`^T -> `[M, N]` float32 (exact float32 under the interpreter)."""
    if DOT_F32:
        return tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)))


@triton.jit
def dot_qk_into(q, k, acc, DOT_F32: tl.constexpr):
    """acc + q `[M, D]` . k `[N, D]`^T: a score that sums two dots (MLA's latent and rope parts) takes the
    smaller one as the larger one's accumulator, so the larger one is the dot whose result feeds no other dot
    (Triton's Hopper layout computes a dot that feeds another on every warpgroup when M is one warpgroup's)."""
    if DOT_F32:
        return tl.dot(q, tl.trans(k.to(q.dtype)), acc, input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)), acc)


@triton.jit
def dot_pv(p, v, acc, q, DOT_F32: tl.constexpr):
    """acc + p `[M, N]` . v `[N, Dv]`: p (float32) and v (maybe FP8) both in q's dtype, as dot_qk reads k."""
    if DOT_F32:
        return tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(p.to(q.dtype), v.to(q.dtype), acc)


@triton.jit
def online_softmax_start(ROWS: tl.constexpr, COLS: tl.constexpr):
    """The running max and sum `[ROWS]` and the output accumulator `[ROWS, COLS]` before the first key tile.

    The max starts at -1e30, not -inf: a row whose tiles so far hid every key then rescales by
    exp2(m_i - m_new) = 1, where -inf - -inf would make it NaN.
    """
    return (tl.full([ROWS], -1.0e30, dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32),
            tl.zeros([ROWS, COLS], dtype=tl.float32))


@triton.jit
def online_softmax_tile(s, visible, m_i, l_i, qk_scale_log2, sm_scale_k, softcap,
                        HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of the online softmax (FlashAttention's running max and sum).

    s `[M, N]` raw q.k^T in float32; visible `[M, N]` (read only when MASKED); m_i, l_i `[M]`
    the running base-2 max and sum. Returns (p `[M, N]` unnormalised probabilities, alpha `[M]`
    the factor that rescales earlier accumulations, the new m_i, the new l_i).
    """
    if HAS_SOFTCAP:
        s = soft_cap(s * sm_scale_k, softcap) * _LOG2E
    else:
        s = s * qk_scale_log2
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def online_softmax_tile_fma(s, m_i, l_i, qk_scale_log2):
    """online_softmax_tile without soft-cap, the scale folded into the exponent: one FMA per score.

    s `[M, N]` raw q.k^T, masked keys already -inf. The max is taken over raw scores (the scale is
    positive), so `s * scale - max` compiles to a single FMA instead of a multiply and a subtract;
    in a compute-bound prefill the softmax's instruction count is what competes with the MMAs.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale_log2 - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new
