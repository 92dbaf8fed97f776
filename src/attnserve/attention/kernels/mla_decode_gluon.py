"""MLA decode on Hopper in Gluon, the host side: where the kernel runs, its grid, its launch.

Why Gluon (`triton.experimental.gluon`) and not `triton.language`: a 64-head program keeps a 64 x 512 float32
output (128 registers a thread over two warpgroups), and Triton's Hopper layout then computes the 64 x 64 score
tile on both warpgroups (53 % of the FLOPs twice), waits on every wgmma and gives no producer/consumer roles
(benchmarks/NOTES.md, MLA). Gluon makes layouts, wgmma waits, mbarriers and warp specialisation explicit.

Four kernels, all 64 query rows or fewer a CTA. The scorer (mla_decode_scorer.py) decodes 64 heads of one token
a CTA, one warpgroup scoring each key tile whole and the other copying the next ones; the tile table puts 128
heads on it (sweep 13: 27.7 against the column split's 29.1 us at 1 x 32768). The column-split one
(mla_decode_colsplit.py) takes the same CTA with the latent's columns halved between its warpgroups. The seesaw
(mla_decode_seesaw.py) takes 64 rows too, each warpgroup its own tile of a round; it runs extend as decode rows
(mla_extend_rows.py), where with fewer heads a CTA takes consecutive tokens of one request x all their heads
(16 heads: 4 tokens), each row masked to its own causal horizon. The narrow one (mla_decode_narrow.py) takes 16
or 32 heads of one token as the columns of keys-major wgmmas, for the memory-bound few-head decode. Gluon has no
interpreter: the CPU tests compile them for sm_90 (benchmarks/compile_mla_sm90.py) and the GPU tests check them
against the oracle. The split plan and the LSE merge are mla_decode.py's, with a CTA's heads counted as a head
group.
"""

from __future__ import annotations

import torch
import triton

from attnserve.attention.kernels.common import LOG2E
from attnserve.attention.kernels.mla_decode_colsplit import _mla_decode_colsplit_kernel
from attnserve.attention.kernels.mla_decode_narrow import _mla_decode_narrow_kernel
from attnserve.attention.kernels.mla_decode_scorer import _mla_decode_scorer_kernel
from attnserve.attention.kernels.mla_decode_seesaw import _mla_decode_seesaw_kernel

GLUON_BLOCK_H = 64  # query rows per CTA: one 64-row wgmma per warpgroup
GLUON_BLOCK_N = 64  # keys per tile
GLUON_LATENT = 512
GLUON_ROPE = 64
CONSUMER_REGS = 232  # two consumer warpgroups at 232 + the producer's 40-odd: 64512 of the SM's 65536 registers
MAXNREG = 168  # the kernel-wide figure the partitions' budgets are carved from: 168 x 384 threads
COLSPLIT_REGS = 240  # the colsplit and scorer kernels' second warpgroup (setmaxnreg; no producer; ptxas: 255)
NARROW_CONSUMER_REGS = 232  # the narrow kernel's one consumer warpgroup (O^T: 4 x heads registers) beside the producer


def gluon_mla_decode_unsupported(q: torch.Tensor, kv_buffer: torch.Tensor, kv_lora_rank: int) -> str | None:
    """Why the Gluon kernel cannot run this call (None: it can)."""
    if q.device.type != "cuda":
        return "the Gluon MLA kernel needs a CUDA device (no interpreter)"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the Gluon MLA kernel is written for Hopper (sm90) wgmma"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_buffer.dtype != q.dtype:
        return f"the Gluon MLA kernel takes a bf16/fp16 query and latent of one dtype, got {q.dtype} / {kv_buffer.dtype}"
    if kv_lora_rank != GLUON_LATENT or q.shape[-1] != GLUON_LATENT + GLUON_ROPE:
        return f"the Gluon MLA kernel is built for a {GLUON_LATENT}+{GLUON_ROPE} latent, got {kv_lora_rank}+" \
               f"{q.shape[-1] - kv_lora_rank}"
    if kv_buffer.stride(0) % 8 or q.stride(1) % 8 or q.stride(0) % 8:
        return "the Gluon MLA kernel copies 16-byte vectors: row strides must be multiples of 8 elements"
    return None


def latent_descriptor(kv_buffer: torch.Tensor):
    """A TMA descriptor over the latent pool's rows `[tokens, 576]`, 64 x 64 boxes in the kernels' 128-byte swizzle:
    the column-split kernel loads a tile of a page of 64 tokens or more this way (mla_decode_colsplit.py says why)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype = gl.bfloat16 if kv_buffer.dtype == torch.bfloat16 else gl.float16
    box = [GLUON_BLOCK_N, GLUON_ROPE]
    return TensorDescriptor(kv_buffer, [kv_buffer.shape[0], GLUON_LATENT + GLUON_ROPE], [kv_buffer.stride(0), 1], box,
                            gl.NVMMASharedLayout.get_default_for(box, dtype))


def tokens_per_cta(num_heads: int) -> int:
    """Query tokens that share a CTA's 64 rows in extend rows: 64 / heads where heads divide 64 (16 heads: 4)."""
    return GLUON_BLOCK_H // num_heads if num_heads < GLUON_BLOCK_H and GLUON_BLOCK_H % num_heads == 0 else 1


def head_groups_per_cta_row(num_heads: int, tokens: int = 1) -> int:
    """CTAs per (token group, split): the grid's first dimension, and what the split plan counts as programs."""
    return triton.cdiv(num_heads * tokens, GLUON_BLOCK_H)


def launch_mla_decode_gluon(q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits,
                            max_splits: int, page_size: int, sm_scale: float, write_final: bool,
                            partial_strides: tuple[int, ...], token_groups=None, kernel: str = "gluon_seesaw",
                            block_h: int = GLUON_BLOCK_H) -> None:
    """Stage 1 of the split decode (mla_decode.mla_decode_attention merges the partials).

    token_groups: (group_first `[G]`, group_ntok `[G]`, tokens): CTAs of several query tokens each (extend rows,
    mla_extend_rows.py, the seesaw's alone); the per-token arrays stay per token. kernel / block_h: the config's.
    A float16 partial_o (the column-split kernel's alone) holds scaled rows `[Dv + 8]` (mla_decode.py says why)."""
    batch, num_heads, _ = q.shape
    if kernel == "gluon_narrow":
        _mla_decode_narrow_kernel[(triton.cdiv(num_heads, block_h), batch, max_splits)](
            q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits, sm_scale * LOG2E,
            q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1), *partial_strides,
            NUM_HEADS=num_heads, BLOCK_H=block_h, LATENT=GLUON_LATENT, ROPE=GLUON_ROPE, PAGE_SIZE=page_size,
            WRITE_FINAL=write_final, CONSUMER_REGS=NARROW_CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG,
        )
        return
    first, ntok, tokens = token_groups if token_groups is not None else (seq_lens, seq_lens, 1)
    rows = first.numel() if tokens > 1 else batch
    grid = (head_groups_per_cta_row(num_heads, tokens), rows, max_splits)  # a request's head groups are neighbours
    args = (q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits, first, ntok,
            sm_scale * LOG2E, q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1),
            *partial_strides)
    common = {"NUM_HEADS": num_heads, "LATENT": GLUON_LATENT, "ROPE": GLUON_ROPE, "PAGE_SIZE": page_size,
              "WRITE_FINAL": write_final, "TOKENS": tokens, "num_warps": 4}
    if kernel in ("gluon_colsplit", "gluon_scorer"):  # two warpgroups, 256 threads: no kernel-wide register cap
        tma = page_size % GLUON_BLOCK_N == 0  # a tile is 64 rows of one page
        fn = _mla_decode_colsplit_kernel if kernel == "gluon_colsplit" else _mla_decode_scorer_kernel
        fn[grid](*args, **common, CONSUMER_REGS=COLSPLIT_REGS, SCALED=partial_o.dtype == torch.float16 and not write_final,
                 kv_desc=latent_descriptor(kv_buffer) if tma else None)
    else:
        _mla_decode_seesaw_kernel[grid](*args, **common, CONSUMER_REGS=CONSUMER_REGS, maxnreg=MAXNREG)
