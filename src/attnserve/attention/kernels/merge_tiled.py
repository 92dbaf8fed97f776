"""Merge split-KV partials a tile of splits x output columns at a time: for few requests with many splits.

mha/decode.py's merge gives each (request, head) one program that walks its splits one by one. MLA's one long
request (1 x 32768 at 128 heads: 128 heads x 64 splits x 512 float32 columns, 16 MB of partials) is then 128
programs each reading 64 rows of 2 KB in turn, latency-bound. Here each program owns BLOCK_DV columns of one
(request, head) and loads BLOCK_S splits of them at once: 8x the programs and whole tiles in flight. Two passes
over the LSEs (the max first) keep the weights exact without a running rescale.

When one tile holds every split, a program is one warp: its column sums are shuffles, not a reduction through
shared memory across warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import next_pow2

MERGE_COLUMNS = 64  # output columns per program
MERGE_SPLITS = 64  # splits loaded per tile


@triton.jit
def _numerator_weights(w, rows, s_mask, V_DIM: tl.constexpr, SCALED: tl.constexpr):
    """The splits' weights for the partial values (rows `[BLOCK_S]`: pointers to each split's partial row): a
    scaled float16 row holds partial x 2^k, k in its column V_DIM, so its weight is w x 2^-k."""
    if SCALED:
        k = tl.load(rows + V_DIM, mask=s_mask, other=0.0)
        w = w * tl.exp2(-k.to(tl.float32))
    return w


@triton.jit
def _merge_tiled_kernel(
    Out, PartialO, PartialLse, num_splits, v_scale,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, ONE_TILE: tl.constexpr,
    SCALED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_mask = offs_d < V_DIM
    n = tl.load(num_splits + b)
    offs_s = tl.arange(0, BLOCK_S)
    lse_base = PartialLse + b * stride_lb + h * stride_lh
    o_base = PartialO + b * stride_pb + h * stride_ph
    if ONE_TILE:  # every split in one tile: the LSEs and the partials are loaded together, one latency
        s_mask = offs_s < n
        rows = o_base + offs_s * stride_ps  # [BLOCK_S] each split's partial row
        lse = tl.load(lse_base + offs_s, mask=s_mask, other=float("-inf"))  # [BLOCK_S], base 2
        o = tl.load(rows[:, None] + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_DV]
        w = tl.exp2(lse - tl.maximum(tl.max(lse, 0), -1.0e30))
        total = tl.sum(w, 0)
        acc = tl.sum(_numerator_weights(w, rows, s_mask, V_DIM, SCALED)[:, None] * o, 0)
    else:
        m = tl.full([], -1.0e30, dtype=tl.float32)
        for s0 in range(0, n, BLOCK_S):
            lse = tl.load(lse_base + s0 + offs_s, mask=s0 + offs_s < n, other=float("-inf"))  # [BLOCK_S], base 2
            m = tl.maximum(m, tl.max(lse, 0))
        total = tl.full([], 0.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for s0 in range(0, n, BLOCK_S):
            s_mask = s0 + offs_s < n
            rows = o_base + (s0 + offs_s) * stride_ps
            w = tl.exp2(tl.load(lse_base + s0 + offs_s, mask=s_mask, other=float("-inf")) - m)  # [BLOCK_S]
            total += tl.sum(w, 0)
            o = tl.load(rows[:, None] + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(_numerator_weights(w, rows, s_mask, V_DIM, SCALED)[:, None] * o, 0)
    total = tl.where(total > 0.0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, (acc / total * v_scale).to(Out.dtype.element_ty),
             mask=d_mask)


def merge_splits_tiled(out: torch.Tensor, partial_o: torch.Tensor, partial_lse: torch.Tensor,
                       num_splits: torch.Tensor, max_splits: int, v_scale: float) -> None:
    """Stage 2 as mha.decode.merge_splits (no sinks): out `[B, H, Dv]` from partial_o `[B, H, S, Dv]` (normalised)
    and partial_lse `[B, H, S]` (base 2), the first num_splits[b] splits of request b. A float16 partial_o is
    `[B, H, S, Dv + 8]`, each row scaled by a power of two 2^k held in its column Dv (mla/attention.py says why)."""
    batch, num_heads, v_dim = out.shape
    block_dv = min(MERGE_COLUMNS, next_pow2(v_dim))
    block_s = max(2, min(MERGE_SPLITS, next_pow2(max_splits)))
    one_tile = max_splits <= block_s
    _merge_tiled_kernel[(batch, num_heads, triton.cdiv(v_dim, block_dv))](
        out, partial_o, partial_lse, num_splits, v_scale,
        out.stride(0), out.stride(1), partial_o.stride(0), partial_o.stride(1), partial_o.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        V_DIM=v_dim, BLOCK_DV=block_dv, BLOCK_S=block_s, ONE_TILE=one_tile, SCALED=partial_o.dtype == torch.float16,
        num_warps=1 if one_tile else 4,
    )
