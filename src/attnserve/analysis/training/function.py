"""`flash_attention`: attention as a torch.autograd.Function whose backward recomputes P from the row LSE.

The forward saves Q, K, V, O and the row LSE (one float per query row); the backward recomputes
P = exp(QK^T * scale - LSE) tile by tile and forms

    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dO * O));  dQ = dS K * scale;  dK = dS^T Q * scale

(with softcap, dS also carries the factor 1 - tanh^2 of the capped score). On CUDA, and on the CPU when
TRITON_INTERPRET=1 asks for it, the Triton kernels of analysis.training.kernels do the work; otherwise the
blockwise torch path of analysis.training.reference does, with the same interface and the same memory
behaviour.
"""

from __future__ import annotations

import math
import os

import torch

from attnserve._lazy import is_installed
from attnserve.analysis.training import reference

IMPLS = ("triton", "torch")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None,
           softcap: float | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be [batch, heads, tokens, head_dim]")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"causal attention needs at least as many keys ({k.shape[2]}) as queries ({q.shape[2]})")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")


def _pick(q: torch.Tensor, impl: str | None) -> str:
    if impl is None:
        if q.is_cuda and is_installed("triton"):
            return "triton"
        return "triton" if _interpreting() and is_installed("triton") else "torch"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _lastdim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashAttentionFunction(torch.autograd.Function):
    """(q, k, v, causal, sm_scale, window, softcap, impl) -> (out, lse); lse is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, window, softcap, impl):
        q, k, v = (_lastdim_contiguous(t) for t in (q, k, v))
        if impl == "triton":
            from attnserve.analysis.training import kernels

            o, lse = kernels.forward(q, k, v, causal, sm_scale, window, softcap)
        else:
            o, lse = reference.blockwise_forward(q, k, v, causal, sm_scale, window, softcap)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, sm_scale, window, softcap, impl)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, sm_scale, window, softcap, impl = ctx.args
        do = _lastdim_contiguous(do)
        if impl == "triton":
            from attnserve.analysis.training import kernels

            dq, dk, dv = kernels.backward(do, q, k, v, o, lse, causal, sm_scale, window, softcap)
        else:
            dq, dk, dv = reference.blockwise_backward(do, q, k, v, o, lse, causal, sm_scale, window, softcap)
        return dq, dk, dv, None, None, None, None, None


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                             sm_scale: float | None = None, window: int | None = None,
                             softcap: float | None = None, impl: str | None = None):
    """(out [B, Hq, Tq, D], lse [B, Hq, Tq]): the attention output and its natural-log row LSE.

    q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D] with Hq a multiple of Hkv (GQA); query row i sits at key
    position i + Tk - Tq. causal: key j visible when j <= that position; window W: only when
    j > position - W; softcap c: scores become c * tanh(s / c). sm_scale defaults to 1 / sqrt(D).
    impl: "triton" or "torch" (default: Triton on CUDA or under TRITON_INTERPRET=1, else torch).
    """
    _check(q, k, v, causal, window, softcap)
    impl = _pick(q, impl)
    d = q.shape[-1]
    if impl == "triton" and (d & (d - 1) or (q.is_cuda and not 16 <= d <= 128)):
        raise ValueError(f"the Triton kernels take a power-of-two head_dim (16 to 128 on a GPU), got {d}; "
                         "impl='torch' takes any")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    return FlashAttentionFunction.apply(q, k, v, bool(causal), scale, window, softcap, impl)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None, window: int | None = None, softcap: float | None = None,
                    impl: str | None = None) -> torch.Tensor:
    """Differentiable attention output [B, Hq, Tq, D]; see flash_attention_with_lse for the arguments."""
    return flash_attention_with_lse(q, k, v, causal, sm_scale, window, softcap, impl)[0]
