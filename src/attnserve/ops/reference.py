"""The unfused torch compositions: the CPU path, the fallback without Triton, and the oracles.

Each function is what a model computed before fusion, step by step, with the same
rounding points (HF's reference implementations): the fused kernels in ops/kernels/
are tested against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x `[..., N]` -> weight * (x / rms(x)), the norm in float32 and cast back before the weight."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): the residual add in the activation dtype, then the norm."""
    summed = x + residual
    return rmsnorm(summed, weight, eps), summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up `[T, 2N]` (gate first) -> silu(gate) * up `[T, N]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
