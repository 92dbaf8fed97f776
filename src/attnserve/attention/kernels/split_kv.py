"""Split-KV pieces both decode families share: a program's split, its key range, its epilogue, the partial buffers.

A decode program owns one (request, head group, split); each split writes a normalised partial output and its
base-2 log-sum-exp, which a merge kernel combines (mha/decode.py's, or merge_tiled.py's for many splits). With
one split everywhere the epilogue writes the final output itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import to_log2


@triton.jit
def split_program(num_splits):
    """A split decode program's (request, head group, split) and its request's split count: a split past the count
    has nothing to do, which the kernel checks before it reads anything else."""
    b = tl.program_id(0)
    return b, tl.program_id(1), tl.program_id(2), tl.load(num_splits + b)


@triton.jit
def split_bounds(start, seq, n_splits, split, BLOCK_N: tl.constexpr):
    """[lo, hi) of one split of keys start..seq: chunks of whole tiles, so only a split's last tile is partial."""
    chunk = tl.cdiv(tl.cdiv(seq - start, n_splits), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    return lo, tl.minimum(lo + chunk, seq)


@triton.jit
def finish_split(acc, m_i, l_i, Out, PartialO, PartialLse, Sinks, b, head, h_mask, split, offs_dv, dv_mask, v_scale,
                 stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                 HAS_SINKS: tl.constexpr, WRITE_FINAL: tl.constexpr):
    """A split's epilogue: the final output (one split per request) or a normalised partial and its base-2 LSE."""
    if WRITE_FINAL:
        if HAS_SINKS:
            sink = to_log2(tl.load(Sinks + head, mask=h_mask, other=0.0))
            l_i += tl.exp2(tl.minimum(sink - m_i, 126.0))  # capped: no overflow when nothing is visible
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None] * v_scale
        tl.store(Out + b * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 o.to(Out.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # base 2
        o = acc / l_safe[:, None]
        tl.store(PartialO + b * stride_pb + head[:, None] * stride_ph + split * stride_ps + offs_dv[None, :],
                 o, mask=h_mask[:, None] & dv_mask[None, :])
        tl.store(PartialLse + b * stride_lb + head * stride_lh + split, lse, mask=h_mask)


def allocate_partials(batch: int, num_heads: int, max_splits: int, v_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 outputs: normalised partial o [B, Hq, S, Dv] and base-2 LSE [B, Hq, S], float32."""
    partial_o = torch.empty(batch, num_heads, max_splits, v_dim, dtype=torch.float32, device=device)
    partial_lse = torch.empty(batch, num_heads, max_splits, dtype=torch.float32, device=device)
    return partial_o, partial_lse


def split_outputs(out: torch.Tensor, partials, max_splits: int, write_final: bool):
    """(partial_o, partial_lse) for stage 1: the given buffers (checked), new ones, or `out` when unused."""
    batch, num_heads, v_dim = out.shape
    if write_final:
        return partials if partials is not None else (out, out)
    if partials is None:
        return allocate_partials(batch, num_heads, max_splits, v_dim, out.device)
    if partials[0].shape[0] < batch or partials[0].shape[2] < max_splits:
        raise ValueError(f"partial buffers {tuple(partials[0].shape)} too small for batch {batch} x {max_splits} splits")
    return partials


def partial_strides(partial_o: torch.Tensor, partial_lse: torch.Tensor) -> tuple[int, ...]:
    return (partial_o.stride(0), partial_o.stride(1), partial_o.stride(2) if partial_o.dim() > 2 else 0,
            partial_lse.stride(0), partial_lse.stride(1))
