"""SiLU(gate) * up over the fused gate|up projection output, in one pass.

The unfused composition (`F.silu(gate) * up` on the two halves) reads the
projection twice and writes an intermediate; this reads each half once and writes
the product. Rounding follows the composition: SiLU is computed in float32 and
rounded to the activation dtype before the multiply, which is rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(GateUp, Out, stride_in, stride_out, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_predecessor(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(GateUp + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_in + N + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_out + offs, (act * up).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """gate_up `[T, 2N]` (gate first) -> silu(gate) * up `[T, N]` in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul needs gate_up [tokens, 2 * N] contiguous in its last dimension, "
                         f"got shape {tuple(gate_up.shape)} stride {gate_up.stride()}")
    tokens, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, n)  # [T, N]
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(n, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                         N=n, BLOCK=BLOCK, num_warps=4, **launch_options(pdl))
    return out
