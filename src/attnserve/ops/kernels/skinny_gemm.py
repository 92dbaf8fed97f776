"""y = x @ W^T for a few rows of x (a decode step's M <= 64 tokens): a candidate against cuBLAS, not wired.

At decode a projection reads its whole weight matrix for a handful of rows, so its floor is the weights' bytes
over the memory bandwidth. On the H200 the Llama-3-8B decode step at batch 64 spent 4.35 ms in cuBLAS GEMMs
against 3.59 ms of weight reads (benchmarks/results/engine_gpu_profile.json), which is most of what separates
the step from the roofline. This kernel is built only for that regime: each program owns BLOCK_N output
columns, streams its [BLOCK_N, K] slab of W once, and pads the M rows to one MMA tile (the wasted FLOPs are
free when the weights' bytes bound the time). Where the columns alone cannot fill the GPU (N = 4096 at
K = 14336), K is split across programs and a second kernel sums the float32 partials in a fixed order, so the
result does not depend on scheduling.

`benchmarks/gemm_skinny_gpu.py` races it against torch's F.linear at the Llama-3-8B shapes; the engine keeps
cuBLAS until that race says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import dot_dtype_is_f32, interpreting, next_pow2
from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars

MAX_ROWS = 64  # one MMA tile of rows; more rows belong to a regular GEMM


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64  # output columns per program
    block_k: int = 128  # weight columns per loop step
    split_k: int = 1  # programs along K, summed by _split_sum
    num_warps: int = 4
    num_stages: int = 4  # weight tiles in flight


def default_config(m: int, n: int, k: int, programs_wanted: int) -> SkinnyConfig:
    """A first guess (the race's sweep measures the rest): 64 columns a program, and K split until about
    `programs_wanted` programs run (twice the SMs), keeping at least four K steps per program."""
    block_n, block_k = 64, 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= programs_wanted and k // (block_k * split * 2) >= 4:
        split *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split)


@triton.jit
def _skinny_gemm_kernel(X, W, Y, Partial, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT: tl.constexpr, DOT_F32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    row_ok = offs_m < M
    col_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if DOT_F32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT == 1:
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        part = Partial + pid_k.to(tl.int64) * M * N
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _split_sum(Partial, Y, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Y[m, n] = sum over s of Partial[s, m, n], s in order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        total += tl.load(Partial + s * M * N + offs, mask=ok, other=0.0)
    m, n = offs // N, offs % N
    tl.store(Y + m * stride_ym + n, total.to(Y.dtype.element_ty), mask=ok)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None,
                  programs_wanted: int | None = None) -> torch.Tensor:
    """x `[M, K]` (M <= 64), weight `[N, K]` as F.linear takes it, contiguous in K -> `[M, N]` (x's dtype)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear needs x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("skinny_linear needs x and weight contiguous in K")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}: use a regular GEMM")
    y = x.new_empty(m, n)  # [M, N]
    if m == 0:
        return y
    if config is None:
        if programs_wanted is None:
            programs_wanted = 2 * (torch.cuda.get_device_properties(x.device).multi_processor_count
                                   if x.is_cuda else 2)
        config = default_config(m, n, k, programs_wanted)
    block_m = max(16, next_pow2(m))
    split = max(1, config.split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no program left without keys
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y  # [S, M, N]
    if interpreting():
        let_interpreter_index_with_loaded_scalars()  # the K loop's bounds are computed scalars
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n), split)](
        x, weight, y, partial, m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_per_split,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=split,
        DOT_F32=dot_dtype_is_f32(x, weight), num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        block = 1024
        _split_sum[(triton.cdiv(m * n, block),)](partial, y, m, n, y.stride(0), SPLIT=split, BLOCK=block)
    return y
