"""RMSNorm, optionally fused with the residual add before it, in one pass over each row.

The unfused composition this replaces (ops/reference.py) is three or four launches:
`r = x + residual` (rounded to the activation dtype), `xf = r.float()`,
`y = (xf * rsqrt(mean(xf^2) + eps)).to(dtype)`, `out = weight * y`. The kernel keeps
the same rounding points so it matches that composition to the last bit up to the
order of the sum of squares: the sum is rounded before the norm reads it, the
normalised row is rounded before the weight multiplies it (a bf16 x bf16 product is
exact in float32, so one rounding after it equals a bf16 multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import next_pow2
from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out, R_out, eps,
    stride_x, stride_r, stride_o, stride_ro,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(R_out.dtype.element_ty)  # the residual stream keeps the activation dtype
        tl.store(R_out + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * rstd).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * y).to(Out.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 1 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"rmsnorm needs x [rows, N] and a weight [N]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("rmsnorm needs rows contiguous in their last dimension and a contiguous weight")


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[..., N]` as rows `[prod(...), N]` (a copy only when the leading dims cannot be flattened)."""
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rmsnorm needs x [..., N] and a weight [N]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _launch(x, residual, weight, eps, out, residual_out, pdl: bool) -> None:
    n = x.shape[1]
    block = next_pow2(n)
    r, ro = (residual, residual_out) if residual is not None else (x, out)
    _rmsnorm_kernel[(x.shape[0],)](
        x, r, weight, out, ro, float(eps),
        x.stride(0), r.stride(0), out.stride(0), ro.stride(0),
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 8), **launch_options(pdl),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """x `[..., N]` (q/k norms pass `[T, H, D]`), weight `[N]` -> same shape, x's dtype, contiguous."""
    rows = _rows(x, weight)
    _check(rows, weight)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [rows, N]
    if rows.shape[0]:
        _launch(rows, None, weight, eps, out, None, pdl)
    return out.view(x.shape)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual), both `[T, N]` in x's dtype, from one read of each input."""
    _check(x, weight)  # the residual stream is always [tokens, hidden]
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x's {tuple(x.shape)} "
                         "and be contiguous in its last dimension")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, N] normalised
    residual_out = torch.empty_like(out)  # [T, N] the new residual stream
    if x.shape[0]:
        _launch(x, residual, weight, eps, out, residual_out, pdl)
    return out, residual_out
