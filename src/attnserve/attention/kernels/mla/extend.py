"""MLA extend / prefill in Triton: the absorbed path over the latent pool.

Absorbed (`mla_extend_attention`): the new tokens' queries, folded into latent space, attend to the
request's whole latent KV through the page table (cached prefix, chunked prefill, radix hits and
this step's rows alike). As in MLA decode the score is q_c . c + q_pe . k_pe and V is the latent
tile already loaded for K. Tiles, their order and the causal / custom-mask rules are extend_tiles.py's.

Fresh prompts may run expanded instead (mha/extend.py's `expanded_prefill_attention`): per-head keys and
values through the MHA extend kernel, the backend's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels import common
from attnserve.attention.kernels.extend_tiles import extend_tile, key_tile_range, mask_kind, visible_keys
from attnserve.attention.kernels.gpu_target import GpuTarget, TileShape, settle_config, target_for
from attnserve.attention.kernels.mla.latent import latent_query, latent_rows
from attnserve.attention.kernels.mla.shapes import check_mla_shapes
from attnserve.attention.kernels.params import ExtendRows


@dataclass(frozen=True)
class MLAExtendConfig:
    block_m: int = 64  # query positions (of one head) per program
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    defer_pv: bool = False  # as MLADecodeConfig's: 8 warps split the score dot instead of computing it twice

    def positions_per_tile(self, group: int) -> int:
        """Same contract as ExtendConfig's: the host tile list is built with this many positions."""
        return self.block_m


# arch -> tiles. A program holds q_c and a [block_m, kv_lora_rank] float32 accumulator, so rows are fewer than
# MHA extend's. sm90: 32 rows over 64-key tiles on 4 warps (faster than 32-key tiles and than 64 rows on 8 warps,
# deferred PV or not); sm80: 64 rows on 8 warps; 99 KiB GPUs: 32 rows over 16-key tiles.
MLA_EXTEND_TILES = {
    "sm90": MLAExtendConfig(32, 64, 4, 2),
    "sm80": MLAExtendConfig(64, 32, 8, 2),
    "sm86": MLAExtendConfig(32, 16, 4, 2),
    "sm89": MLAExtendConfig(32, 16, 4, 2),
    "default": MLAExtendConfig(32, 16, 4, 2),
}
INTERPRETER_MLA_EXTEND_TILES = MLAExtendConfig(16, 16, 4, 1)


def default_mla_extend_config(device: torch.device, target: GpuTarget | None = None) -> MLAExtendConfig:
    device = torch.device(device)
    if device.type != "cuda" and target is None:
        return INTERPRETER_MLA_EXTEND_TILES
    return MLA_EXTEND_TILES[(target or target_for(device)).arch]


@triton.jit
def _mla_block(acc, m_i, l_i, p_prev, alpha_prev, q_c, q_r, n0, lo, KV, kv_indices, page_base, seq, q_row, q_pos,
               m_mask, Mask, mask_base, qk_scale_log2, stride_kvt, offs_c, offs_r, r_mask,
               BLOCK_N: tl.constexpr, LATENT: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
               HAS_CUSTOM_MASK: tl.constexpr, DEFER_PV: tl.constexpr, DOT_F32: tl.constexpr):
    """One latent key tile; MASKED: a tile on the diagonal (or any tile under a custom mask).

    DEFER_PV (as in mla/decode.py): the previous tile's probabilities p_prev meet its latent here, read again,
    and this tile's are returned for the next call; otherwise p_prev / alpha_prev pass through untouched."""
    if DEFER_PV:
        row_prev, prev_valid = latent_rows(KV, kv_indices, page_base, n0 - BLOCK_N, lo, seq, stride_kvt, BLOCK_N,
                                           PAGE_SIZE, False)
        c_prev = tl.load(row_prev + offs_c[None, :], mask=prev_valid[:, None], other=0.0)  # [BLOCK_N, LATENT]
        acc = common.dot_pv(p_prev, c_prev, acc * alpha_prev[:, None], q_c, DOT_F32)
    row, n_valid = latent_rows(KV, kv_indices, page_base, n0, lo, seq, stride_kvt, BLOCK_N, PAGE_SIZE, False)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    c = tl.load(row + offs_c[None, :], mask=n_valid[:, None], other=0.0)  # [BLOCK_N, LATENT]: K and V
    k_pe = tl.load(row + LATENT + offs_r[None, :], mask=n_valid[:, None] & r_mask[None, :], other=0.0)
    s = common.dot_qk_into(q_c, c, common.dot_qk(q_r, k_pe, DOT_F32), DOT_F32)  # [BLOCK_M, BLOCK_N]
    visible = None
    if MASKED:
        visible = visible_keys(offs_n, n_valid, m_mask, q_row, q_pos, seq, Mask, mask_base, 0, False, HAS_CUSTOM_MASK)
    p, alpha, m_i, l_i = common.online_softmax_tile(s, visible, m_i, l_i, qk_scale_log2, 1.0, 1.0, False, MASKED)
    if DEFER_PV:
        p_prev = p
        alpha_prev = alpha
    else:
        acc = common.dot_pv(p, c, acc * alpha[:, None], q_c, DOT_F32)
    return acc, m_i, l_i, p_prev, alpha_prev


@triton.jit
def mla_extend_kernel(
    Q, KV, Out, tile_req, tile_m0, qo_indptr, kv_indptr, kv_indices, seq_lens, Mask, mask_indptr,
    qk_scale_log2, v_scale,
    stride_qt, stride_qh, stride_kvt, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr, DEFER_PV: tl.constexpr, DOT_F32: tl.constexpr,
):
    head = tl.program_id(0)
    m0, q_start, ext, seq, prefix, page_base, mask_base = extend_tile(tile_req, tile_m0, qo_indptr, kv_indptr,
                                                                     seq_lens, mask_indptr, HAS_CUSTOM_MASK)

    q_row = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows among the request's new tokens
    m_mask = q_row < ext
    q_pos = prefix + q_row
    offs_c = tl.arange(0, LATENT)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROPE
    # [BLOCK_M, LATENT] and [BLOCK_M, BLOCK_R]
    q_c, q_r = latent_query(Q + (q_start + q_row)[:, None] * stride_qt + head * stride_qh, m_mask, LATENT, ROPE,
                            BLOCK_R, DOT_F32)

    m_i, l_i, acc = common.online_softmax_start(BLOCK_M, LATENT)
    p_prev = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # DEFER_PV's carried tile (see _mla_block)
    alpha_prev = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    lo, full_end, hi = key_tile_range(prefix, m0, seq, 0, BLOCK_M, BLOCK_N, False, HAS_CUSTOM_MASK)
    for n0 in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i, p_prev, alpha_prev = _mla_block(
            acc, m_i, l_i, p_prev, alpha_prev, q_c, q_r, n0, lo, KV, kv_indices, page_base, seq, q_row, q_pos,
            m_mask, Mask, mask_base, qk_scale_log2, stride_kvt, offs_c, offs_r, r_mask,
            BLOCK_N, LATENT, PAGE_SIZE, False, HAS_CUSTOM_MASK, DEFER_PV, DOT_F32)
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i, p_prev, alpha_prev = _mla_block(
            acc, m_i, l_i, p_prev, alpha_prev, q_c, q_r, n0, lo, KV, kv_indices, page_base, seq, q_row, q_pos,
            m_mask, Mask, mask_base, qk_scale_log2, stride_kvt, offs_c, offs_r, r_mask,
            BLOCK_N, LATENT, PAGE_SIZE, True, HAS_CUSTOM_MASK, DEFER_PV, DOT_F32)
    if DEFER_PV:  # the last tile's values
        last = lo + tl.maximum(hi - lo - 1, 0) // BLOCK_N * BLOCK_N
        row_last, last_valid = latent_rows(KV, kv_indices, page_base, last, lo, seq, stride_kvt, BLOCK_N, PAGE_SIZE,
                                           False)
        c_last = tl.load(row_last + offs_c[None, :], mask=last_valid[:, None], other=0.0)
        acc = common.dot_pv(p_prev, c_last, acc * alpha_prev[:, None], q_c, DOT_F32)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None] * v_scale
    tl.store(Out + (q_start + q_row)[:, None] * stride_ot + head * stride_oh + offs_c[None, :],
             o.to(Out.dtype.element_ty), mask=m_mask[:, None])


def mla_extend_attention(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    out: torch.Tensor,
    rows: ExtendRows,
    sm_scale: float,
    kv_lora_rank: int,
    kv_scale: float = 1.0,
    config: MLAExtendConfig | None = None,
    target: GpuTarget | None = None,
) -> torch.Tensor:
    """New tokens of every request against their whole latent KV (absorbed MLA).

    q `[T, H, kv_lora_rank + rope]`, kv_buffer `[slots, 1, kv_lora_rank + rope]`, out `[T, H, kv_lora_rank]`;
    rows as mha.extend.extend_attention takes them (params.ExtendRows); `rows.tiles` must cover `config.block_m`
    positions each.
    """
    tiles, qo_indptr, kv_indptr, kv_indices = rows.tiles, rows.qo_indptr, rows.kv_indptr, rows.kv_indices
    seq_lens, page_size, custom_mask, mask_indptr = rows.seq_lens, rows.page_size, rows.custom_mask, rows.mask_indptr
    num_tokens, num_heads, width = q.shape
    rope = check_mla_shapes(q, kv_buffer, out, kv_lora_rank)
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("custom_mask and mask_indptr must be given together")
    target = target or target_for(q.device)

    def tile_shape(c: MLAExtendConfig) -> TileShape:
        return TileShape(c.block_m, width, c.block_n, width + kv_lora_rank * c.defer_pv, c.num_stages,
                         q.element_size())

    config = settle_config("MLA extend", config, default_mla_extend_config(q.device, target), tile_shape, target)
    if tiles.positions != config.block_m:
        raise ValueError(f"tiles cover {tiles.positions} positions, the config's tiles {config.block_m}")
    if num_tokens == 0 or tiles.num_tiles == 0:
        return out
    if custom_mask is not None and custom_mask.dtype == torch.bool:
        custom_mask = custom_mask.view(torch.uint8)
    mla_extend_kernel[(num_heads, tiles.num_tiles)](
        q, kv_buffer, out, tiles.tile_req, tiles.tile_m0, qo_indptr, kv_indptr, kv_indices, seq_lens,
        custom_mask if custom_mask is not None else q, mask_indptr if mask_indptr is not None else qo_indptr,
        sm_scale * kv_scale * common.LOG2E, kv_scale,
        q.stride(0), q.stride(1), kv_buffer.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, LATENT=kv_lora_rank, ROPE=rope,
        BLOCK_R=max(16, common.next_pow2(rope)), PAGE_SIZE=page_size,
        HAS_CUSTOM_MASK=mask_kind(custom_mask, rows.mask_new_keys_only),
        DEFER_PV=config.defer_pv, DOT_F32=common.dot_dtype_is_f32(q), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


