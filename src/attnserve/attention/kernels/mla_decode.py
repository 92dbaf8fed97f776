"""MLA decode over the latent pool: Flash-Decoding with one shared KV "head" per token.

The pool row of a token is [c | k_pe]: the compressed latent (kv_lora_rank wide, e.g. 512) and
the decoupled RoPE key (e.g. 64). In the absorbed form every query head is MQA against it:
score = q_c . c + q_pe . k_pe and output = sum p c, so V is the latent already loaded for K.
One program owns BLOCK_H query heads of one request and one KV split: each latent byte is
read once per head group, and the two dots of the score share one online softmax.

Split-KV is decode.py's (same partial layout, same split plan), merged a tile of splits x columns at a time
(merge_tiled.py: one long request cut into many splits is MLA's common case); FP8 (e4m3)
latents carry one per-tensor scale, folded into the softmax scale and the output.

Float16 partials (the column-split Gluon kernel's, `MLADecodeConfig.partials`): one long request at 128 heads
ends its wave by writing 64 splits x 128 heads x 512 normalised partial columns, which the merge kernel reads
back, 16.8 MB in float32; float16 halves that (H200, 1 x 32768: 29.7 against 31.2 us with the merge,
benchmarks/NOTES.md). bfloat16 would carry 8 significant bits into the sum; float16 carries 11, three more than
the bf16 output, but not bf16's range, so each partial row is stored times a power of two 2^k that puts its
largest value in [2^14, 2^15), k in the row's column 512 (rows of 512 + 8 halves in the float32 buffers' bytes):
every value within 2^28 of its row's largest keeps the 11 bits, whatever the latent's magnitude.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import (
    LOG2E,
    dot_dtype_is_f32,
    dot_pv,
    dot_qk,
    dot_qk_into,
    next_pow2,
    online_softmax_tile,
)
from attnserve.attention.kernels.decode import (
    finish_split,
    partial_strides,
    split_bounds,
    split_outputs,
)
from attnserve.attention.kernels.merge_tiled import merge_splits_tiled
from attnserve.attention.kernels.mla_decode_tiles import MLADecodeConfig, tiles_for
from attnserve.attention.kernels.tiles import (
    GpuTarget,
    TileShape,
    check_shared_memory,
    fewest_stages_dropped,
    target_for,
)

# the interpreter's small tiles (CPU tests); GPU tiles come from mla_decode_tiles.json per arch, heads, page size
INTERPRETER_MLA_DECODE_TILES = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)


def default_mla_decode_config(device: torch.device, target: GpuTarget | None = None, num_heads: int = 128,
                              page_size: int = 1) -> MLADecodeConfig:
    """The architecture's tiles for this head count and page size on a GPU (`target`, default: the
    device's); small ones under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" and target is None:
        return INTERPRETER_MLA_DECODE_TILES.for_heads(num_heads)
    return tiles_for((target or target_for(device)).arch, num_heads, page_size)


def gluon_mla_decode_unsupported(q: torch.Tensor, kv_buffer: torch.Tensor, kv_lora_rank: int) -> str | None:
    """Why mla_decode_gluon.py's kernel cannot run this call (None: it can); imported only where it could."""
    if q.device.type != "cuda":
        return "the gluon MLA kernel needs a CUDA device (Gluon has no interpreter)"
    from attnserve.attention.kernels.mla_decode_gluon import gluon_mla_decode_unsupported as why_not

    return why_not(q, kv_buffer, kv_lora_rank)


def _tile_shape(c: MLADecodeConfig, width: int, kv_lora_rank: int, itemsize: int) -> TileShape:
    """A Triton tile's shared memory: a deferred PV buffers the previous tile's latent too."""
    return TileShape(c.block_h, width, c.block_n, width + kv_lora_rank * c.defer_pv, c.num_stages, itemsize)


def runnable_mla_decode_config(q: torch.Tensor, kv_buffer: torch.Tensor, kv_lora_rank: int, page_size: int,
                               target: GpuTarget | None = None) -> MLADecodeConfig:
    """The default tile as this call can run it: the architecture's for the heads and page size, the same tile in
    Triton where the Gluon kernel it names cannot take the call (e.g. an FP8 latent), a Triton tile with the
    stages dropped that would not fit the GPU's shared memory."""
    target = target or target_for(q.device)
    config = default_mla_decode_config(q.device, target, q.shape[1], page_size)
    if config.kernel != "triton" and gluon_mla_decode_unsupported(q, kv_buffer, kv_lora_rank):
        config = dataclasses.replace(config, kernel="triton", partials="float32")  # float16 rows: two Gluon kernels' alone
    if config.kernel == "triton":
        shape = functools.partial(_tile_shape, width=q.shape[-1], kv_lora_rank=kv_lora_rank,
                                  itemsize=q.element_size())
        config = fewest_stages_dropped(config, shape, target)
    return config


def check_mla_shapes(q: torch.Tensor, kv_buffer: torch.Tensor, out: torch.Tensor, kv_lora_rank: int) -> int:
    """Validate an absorbed-MLA call (q `[T, H, rank + rope]`, latent `[slots, 1, rank + rope]`, out `[T, H, rank]`).

    Returns the rope width.
    """
    tokens, num_heads, width = q.shape
    rope = width - kv_lora_rank
    if kv_lora_rank & (kv_lora_rank - 1) or kv_lora_rank < 16:
        raise ValueError(f"kv_lora_rank must be a power of two >= 16 for the MLA kernel, got {kv_lora_rank}")
    if rope < 0 or kv_buffer.dim() != 3 or kv_buffer.shape[1:] != (1, width):
        raise ValueError(f"kv_buffer {tuple(kv_buffer.shape)} does not match q's width {width} "
                         f"(kv_lora_rank {kv_lora_rank} + rope {rope}, one latent head)")
    if out.shape != (tokens, num_heads, kv_lora_rank):
        raise ValueError(f"out {tuple(out.shape)} must be [{tokens}, {num_heads}, {kv_lora_rank}]")
    if q.stride(-1) != 1 or kv_buffer.stride(-1) != 1:
        raise ValueError("q and kv_buffer must be contiguous in their last dimension")
    return rope


def head_groups(num_heads: int, config: MLADecodeConfig) -> int:
    """Programs per (request, split): what the split plan counts as KV heads for MLA."""
    return triton.cdiv(num_heads, config.block_h)


@triton.jit
def _latent_rows(KV, kv_indices, page_base, n0, lo, hi, stride_kvt,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr):
    """Row pointers `[BLOCK_N, 1]` of the key tile starting at n0, and which rows lie in [lo, hi) `[BLOCK_N]`."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = (offs_n >= lo) & (offs_n < hi)
    if TILE_IN_PAGE:
        # the tile lies inside one page (tiles start at multiples of BLOCK_N, which divides the page):
        # one page index per tile, and its rows are contiguous in the pool
        page = tl.load(kv_indices + page_base + tl.maximum(n0, 0) // PAGE_SIZE)
        first = page.to(tl.int64) * PAGE_SIZE + (n0 % PAGE_SIZE)
        row = KV + (first + tl.arange(0, BLOCK_N))[:, None] * stride_kvt
    else:
        page = tl.load(kv_indices + page_base + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        row = KV + (page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE)[:, None] * stride_kvt
    return row, n_mask


@triton.jit
def _mla_decode_split_kernel(
    Q, KV, Out, PartialO, PartialLse, kv_indptr, kv_indices, seq_lens, num_splits,
    qk_scale_log2, v_scale,
    stride_qb, stride_qh, stride_kvt, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr, DEFER_PV: tl.constexpr, WRITE_FINAL: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    hg = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.load(num_splits + b)
    if split >= n_splits:
        return
    seq = tl.load(seq_lens + b)
    lo, hi = split_bounds(0, seq, n_splits, split, BLOCK_N)
    page_base = tl.load(kv_indptr + b)

    head = hg * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_mask = head < NUM_HEADS
    offs_c = tl.arange(0, LATENT)  # the latent width is a power of two (512 in DeepSeek)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROPE
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh
    q_c = tl.load(q_ptrs + offs_c[None, :], mask=h_mask[:, None], other=0.0)  # [BLOCK_H, LATENT]
    q_r = tl.load(q_ptrs + LATENT + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    if DOT_F32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], dtype=tl.float32)
    # DEFER_PV: a tile's probabilities are multiplied by its latent one iteration later (the tile is read again,
    # from L2). The score dot then feeds no dot of its own iteration, so Triton's Hopper layout splits its keys
    # over the two warpgroups of 8 warps instead of computing the whole score tile on both.
    # p_prev: the last tile's probabilities (relative to the running max m_i); alpha_prev: the factor taking acc
    # (the tiles before it, relative to the max before it) to m_i, applied as the dot's accumulator input
    p_prev = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    alpha_prev = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        if DEFER_PV:
            row_prev, prev_mask = _latent_rows(KV, kv_indices, page_base, n0 - BLOCK_N, lo, hi, stride_kvt,
                                               BLOCK_N, PAGE_SIZE, TILE_IN_PAGE)
            c_prev = tl.load(row_prev + offs_c[None, :], mask=prev_mask[:, None], other=0.0)  # [BLOCK_N, LATENT]
            acc = dot_pv(p_prev, c_prev, acc * alpha_prev[:, None], q_c, DOT_F32)
        row, n_mask = _latent_rows(KV, kv_indices, page_base, n0, lo, hi, stride_kvt, BLOCK_N, PAGE_SIZE,
                                   TILE_IN_PAGE)
        c = tl.load(row + offs_c[None, :], mask=n_mask[:, None], other=0.0)  # [BLOCK_N, LATENT]: K and V
        k_pe = tl.load(row + LATENT + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if DEFER_PV:  # the latent dot, the larger, must be the one that feeds no dot (common.dot_qk_into)
            s = dot_qk_into(q_c, c, dot_qk(q_r, k_pe, DOT_F32), DOT_F32)  # [BLOCK_H, BLOCK_N]
        else:  # summed as before the deferred PV: same layouts (ptxas), and the same rounding as what was tested
            s = dot_qk(q_c, c, DOT_F32) + dot_qk(q_r, k_pe, DOT_F32)
        p, alpha, m_i, l_i = online_softmax_tile(s, n_mask[None, :], m_i, l_i, qk_scale_log2, 1.0, 1.0,
                                                 False, True)
        if DEFER_PV:
            p_prev = p
            alpha_prev = alpha
        else:
            acc = dot_pv(p, c, acc * alpha[:, None], q_c, DOT_F32)
    if DEFER_PV:  # the last tile's values
        last = lo + tl.maximum(hi - lo - 1, 0) // BLOCK_N * BLOCK_N
        row_last, last_mask = _latent_rows(KV, kv_indices, page_base, last, lo, hi, stride_kvt, BLOCK_N,
                                           PAGE_SIZE, TILE_IN_PAGE)
        c_last = tl.load(row_last + offs_c[None, :], mask=last_mask[:, None], other=0.0)
        acc = dot_pv(p_prev, c_last, acc * alpha_prev[:, None], q_c, DOT_F32)

    finish_split(acc, m_i, l_i, Out, PartialO, PartialLse, Q, b, head, h_mask, split, offs_c, offs_c < LATENT,
                 v_scale, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                 False, WRITE_FINAL)


def mla_decode_attention(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: torch.Tensor,
    max_splits: int,
    page_size: int,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: float = 1.0,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    write_final: bool | None = None,
    config: MLADecodeConfig | None = None,
    target: GpuTarget | None = None,
    token_groups: tuple | None = None,
) -> torch.Tensor:
    """One query token per request against its latent KV (absorbed MLA).

    q `[B, H, kv_lora_rank + rope]` (q_nope folded through W_UK, then q_pe); kv_buffer
    `[slots, 1, kv_lora_rank + rope]` (the MLA pool's buffer, bf16/fp16/fp32 or FP8 e4m3 holding
    x / kv_scale); out `[B, H, kv_lora_rank]`. kv_indptr / kv_indices / seq_lens / num_splits /
    max_splits / write_final / partials as in decode.decode_attention. token_groups: extend rows' CTAs of several
    tokens (mla_extend_rows.ExtendRowsPlan), the Gluon kernel's alone.
    """
    batch, num_heads, width = q.shape
    rope = check_mla_shapes(q, kv_buffer, out, kv_lora_rank)
    if batch == 0:
        return out
    target = target or target_for(q.device)
    if config is None:
        config = runnable_mla_decode_config(q, kv_buffer, kv_lora_rank, page_size, target)
    elif config.kernel != "triton" and (reason := gluon_mla_decode_unsupported(q, kv_buffer, kv_lora_rank)):
        raise ValueError(reason)
    if token_groups is not None and token_groups[2] > 1 and config.kernel != "gluon_seesaw":
        raise ValueError(f"CTAs of several query tokens need the gluon_seesaw MLA kernel, the tile is {config.kernel}'s")
    if write_final is None:
        write_final = max_splits == 1
    partial_o, partial_lse = split_outputs(out, partials, max_splits, write_final)
    if config.kernel != "triton":
        from attnserve.attention.kernels.mla_decode_gluon import launch_mla_decode_gluon

        if config.partials == "float16" and not write_final:  # the float32 rows' bytes, half of each used
            partial_o = partial_o.view(torch.float16)[..., : kv_lora_rank + 8]  # [B, H, S, 512 + 8]
        launch_mla_decode_gluon(q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens,
                                num_splits, max_splits, page_size, sm_scale, write_final,
                                partial_strides(partial_o, partial_lse), token_groups, config.kernel, config.block_h)
        if not write_final:
            merge_splits_tiled(out, partial_o, partial_lse, num_splits, max_splits, 1.0)
        return out
    check_shared_memory("MLA decode", _tile_shape(config, width, kv_lora_rank, q.element_size()), target)
    grid = (batch, head_groups(num_heads, config), max_splits)
    _mla_decode_split_kernel[grid](
        q, kv_buffer, out, partial_o, partial_lse, kv_indptr, kv_indices, seq_lens, num_splits,
        sm_scale * kv_scale * LOG2E, kv_scale,
        q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1),
        *partial_strides(partial_o, partial_lse),
        NUM_HEADS=num_heads, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        LATENT=kv_lora_rank, ROPE=rope, BLOCK_R=max(16, next_pow2(rope)),
        PAGE_SIZE=page_size, TILE_IN_PAGE=page_size % config.block_n == 0, DEFER_PV=config.defer_pv,
        WRITE_FINAL=write_final,
        DOT_F32=dot_dtype_is_f32(q),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not write_final:
        merge_splits_tiled(out, partial_o, partial_lse, num_splits, max_splits, kv_scale)
    return out
