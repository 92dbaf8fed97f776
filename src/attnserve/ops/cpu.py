"""The CPU's op set: RMSNorm in one or two kernels instead of the reference's five.

At decode sizes a CPU op costs its launch more than its arithmetic, and a model runs two norms per
layer each step. float32: `F.rms_norm`, the reference's bits (checked in tests). bf16: torch's
RMSNorm kernel is a composite of several ops there; LayerNorm is one native kernel, and the
LayerNorm of [x, -x] (mean 0, variance mean(x^2)) is x / rms(x), rounded to bf16
once, then times the weight: the reference's rounding points, so its bits except where a value sits on
a rounding boundary (the variance is summed in another order): there one bf16 ulp (checked in tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    if x.dtype == torch.bfloat16:
        mirrored = torch.cat((x, -x), dim=-1)  # [..., 2N]: zero mean, variance mean(x^2)
        return F.layer_norm(mirrored, (2 * n,), None, None, eps)[..., :n] * weight
    return F.rms_norm(x, (n,), weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rmsnorm(summed, weight, eps), summed
