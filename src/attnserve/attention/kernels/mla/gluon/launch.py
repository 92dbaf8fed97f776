"""MLA decode on Hopper in Gluon, the host side: the kernels' grids and their launch.

Why Gluon (`triton.experimental.gluon`) and not `triton.language`: a 64-head program keeps a 64 x 512 float32
output (128 registers a thread over two warpgroups), and Triton's Hopper layout then computes the 64 x 64 score
tile on both warpgroups, waits on every wgmma and gives no producer/consumer roles. Gluon makes layouts, wgmma
waits, mbarriers and warp specialisation explicit.

Three kernels, each in its own module, sharing parts.py:
- scorer.py: 64 heads of one token a CTA, one warpgroup scoring each key tile whole and the other copying the
  next ones; the decode table puts 128 heads on it.
- seesaw.py: 64 rows a CTA, each warpgroup its own tile of a round; it runs extend as decode rows
  (mla/extend_rows.py), where with fewer heads a CTA takes consecutive tokens of one request x all their heads
  (16 heads: 4 tokens), each row masked to its own causal horizon.
- narrow.py: 16 or 32 heads of one token as the columns of keys-major wgmmas, for the memory-bound few-head
  decode.
Gluon has no interpreter: the CPU tests compile them for sm_90 (tools/compile_mla_sm90.py) and the GPU tests
check them against the oracle. Which kernel runs is the layer's KernelPlan (kernels/plan.py); the split plan and
the LSE merge are mla/attention.py's, with a CTA's heads counted as a head group.
"""

from __future__ import annotations

import torch
import triton

from attnserve.attention.kernels.common import LOG2E
from attnserve.attention.kernels.mla.decode_table import (
    GLUON_BLOCK_H,
    GLUON_LATENT,
    GLUON_ROPE,
    tokens_per_cta,
)
from attnserve.attention.kernels.mla.gluon.narrow import mla_decode_narrow_kernel
from attnserve.attention.kernels.mla.gluon.scorer import mla_decode_scorer_kernel
from attnserve.attention.kernels.mla.gluon.seesaw import mla_decode_seesaw_kernel
from attnserve.attention.kernels.params import DecodeRows
from attnserve.attention.kernels.plan import KernelPlan

GLUON_BLOCK_N = 64  # keys per tile
CONSUMER_REGS = 232  # the seesaw's two consumer warpgroups at 232 + the producer's 40-odd: 64512 of 65536 registers
MAXNREG = 168  # the kernel-wide figure the partitions' budgets are carved from: 168 x 384 threads
SCORER_REGS = 240  # the scorer kernel's second warpgroup (setmaxnreg; no producer; ptxas: 255)
NARROW_CONSUMER_REGS = 232  # the narrow kernel's one consumer warpgroup (O^T: 4 x heads registers) beside the producer
# The seesaw (extend rows) skips the causal mask on tiles every row of its CTA sees whole, as the scorer does on
# whole tiles: a compare and a select an element fewer. Off until raced (--gluon-set SEESAW_WHOLE_TILES=1)
SEESAW_WHOLE_TILES = False
# The seesaw's producer carries the next tiles' page indices as loaded and computes their pool rows at the copy
# (parts.fetch_tile), as the scorer's copier does. Off: on an H100 1.00x at 128 heads and 0.97-0.98x at 16 heads over
# 64-token pages (sweep-mla-switches-h100-2.json, -3.json), where the scorer gained 1.25x
SEESAW_PAGES_AHEAD = False


def seesaw_switches() -> dict:
    """The seesaw kernel's constexprs the module switches above set (the launch and tools/compile_mla_sm90.py)."""
    return {"WHOLE_TILES": SEESAW_WHOLE_TILES, "AHEAD": SEESAW_PAGES_AHEAD}


def strides_ok(q: torch.Tensor, kv_buffer: torch.Tensor) -> bool:
    """The kernels copy 16-byte vectors: row strides must be multiples of 8 elements."""
    return not (kv_buffer.stride(0) % 8 or q.stride(1) % 8 or q.stride(0) % 8)


def latent_descriptor(kv_buffer: torch.Tensor):
    """A TMA descriptor over the latent pool's rows `[tokens, 576]`, 64 x 64 boxes in the kernels' 128-byte swizzle:
    the scorer kernel loads a tile of a page of 64 tokens or more this way (a TMA is one instruction, cp.async
    18 a thread)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype = gl.bfloat16 if kv_buffer.dtype == torch.bfloat16 else gl.float16
    box = [GLUON_BLOCK_N, GLUON_ROPE]
    return TensorDescriptor(kv_buffer, [kv_buffer.shape[0], GLUON_LATENT + GLUON_ROPE], [kv_buffer.stride(0), 1], box,
                            gl.NVMMASharedLayout.get_default_for(box, dtype))


def head_groups_per_cta_row(num_heads: int, tokens: int = 1) -> int:
    """CTAs per (token group, split): the grid's first dimension, and what the split plan counts as programs."""
    return triton.cdiv(num_heads * tokens, GLUON_BLOCK_H)


def launch_gluon_mla_decode(q, kv_buffer, out, partial_o, partial_lse, rows: DecodeRows, plan: KernelPlan,
                            sm_scale: float, write_final: bool) -> None:
    """Stage 1 of the split decode on the plan's Gluon kernel (mla.attention.mla_decode_attention merges).

    rows.token_groups: (group_first `[G]`, group_ntok `[G]`, tokens): CTAs of several query tokens each (extend
    rows, the seesaw's alone); the per-token arrays stay per token. A float16 partial_o (the scorer's) holds scaled rows `[Dv + 8]` (mla/attention.py says
    why)."""
    if not strides_ok(q, kv_buffer):
        raise ValueError("the Gluon MLA kernels copy 16-byte vectors: row strides must be multiples of 8 elements")
    kv_indptr, kv_indices, seq_lens, num_splits = rows.kv_indptr, rows.kv_indices, rows.seq_lens, rows.num_splits
    max_splits, page_size, token_groups = rows.max_splits, rows.page_size, rows.token_groups
    batch, num_heads, _ = q.shape
    kernel = plan.kernel
    strides = (partial_o.stride(0), partial_o.stride(1), partial_o.stride(2) if partial_o.dim() > 2 else 0,
               partial_lse.stride(0), partial_lse.stride(1))
    if kernel == "gluon_narrow":
        block_h = plan.config.block_h
        mla_decode_narrow_kernel[(triton.cdiv(num_heads, block_h), batch, max_splits)](
            q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits, sm_scale * LOG2E,
            q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1), *strides,
            NUM_HEADS=num_heads, BLOCK_H=block_h, LATENT=GLUON_LATENT, ROPE=GLUON_ROPE, PAGE_SIZE=page_size,
            WRITE_FINAL=write_final, CONSUMER_REGS=NARROW_CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG,
        )
        return
    first, ntok, tokens = token_groups if token_groups is not None else (seq_lens, seq_lens, 1)
    n_rows = first.numel() if tokens > 1 else batch
    grid = (head_groups_per_cta_row(num_heads, tokens), n_rows, max_splits)  # a request's head groups are neighbours
    args = (q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits, first, ntok,
            sm_scale * LOG2E, q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1), *strides)
    common = {"NUM_HEADS": num_heads, "LATENT": GLUON_LATENT, "ROPE": GLUON_ROPE, "PAGE_SIZE": page_size,
              "WRITE_FINAL": write_final, "TOKENS": tokens, "num_warps": 4}
    if kernel == "gluon_scorer":  # two warpgroups, 256 threads: no kernel-wide register cap
        tma = page_size % GLUON_BLOCK_N == 0  # a tile is 64 rows of one page
        mla_decode_scorer_kernel[grid](*args, **common, CONSUMER_REGS=SCORER_REGS,
                                       SCALED=partial_o.dtype == torch.float16 and not write_final,
                                       kv_desc=latent_descriptor(kv_buffer) if tma else None)
    else:
        mla_decode_seesaw_kernel[grid](*args, **common, CONSUMER_REGS=CONSUMER_REGS, maxnreg=MAXNREG,
                                       **seesaw_switches())


__all__ = ["launch_gluon_mla_decode", "latent_descriptor", "head_groups_per_cta_row", "strides_ok", "tokens_per_cta"]
