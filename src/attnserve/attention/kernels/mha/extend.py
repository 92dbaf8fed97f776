"""Extend / prefill over the paged pool, FlashAttention-2 style.

One program owns a tile of BLOCK_M query rows of one request: BLOCK_M positions of one
query head, or with GQA packing (ExtendConfig.pack_gqa) every query head of one KV head
at BLOCK_M / group consecutive positions, so the causal diagonal cuts through fewer key
tiles. It sweeps the request's keys through the page table: the cached prefix and this
step's new tokens alike (the new K/V are in the pool before the kernel runs, so an
FP8 pool is read exactly as decode will read it later). Key tiles every row of the
tile may see are processed without masks; only tiles on the causal diagonal (or
every tile, with a sliding window or a custom mask) build a mask. Tiles entirely
in the future of every row are never visited.

Ragged batches: the host builds a list of (request, first row) tiles in plan(), the
heaviest first so the long causal tiles start early. The grid is (heads, tiles) with
heads fastest, so programs reading the same keys run side by side and share them in L2.

Expanded MLA prefill (`expanded_prefill_attention`) is this kernel too: a fresh prompt has no prefix to read,
so its latent may be expanded to per-head keys (nope + rope, 192 wide in DeepSeek) and values (128 wide), fewer
FLOPs than attending in the 576/512-wide latent space. That is plain ragged causal attention with V narrower
than K, run over the new tokens as a page-size-1 "pool".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels import common
from attnserve.attention.kernels.extend_tiles import (
    ExtendTiles,
    build_extend_tiles,
    extend_tile,
    key_tile_range,
    mask_kind,
    visible_keys,
)
from attnserve.attention.kernels.gpu_target import GpuTarget, TileShape, settle_config, target_for
from attnserve.attention.kernels.params import ExtendRows, LayerParams
from attnserve.transfers import to_device


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # one program runs every query head of a KV head (BLOCK_M rows = positions x group): faster on some
    # shapes, slower on others, so it is off by default
    pack_gqa: bool = False

    def positions_per_tile(self, group: int) -> int:
        """Query positions one tile covers: block_m rows shared by the `pack` heads of each position."""
        return max(1, self.block_m // pack_factor(self, group))


def pack_factor(config: ExtendConfig, group: int) -> int:
    return group if config.pack_gqa and 1 < group <= config.block_m else 1


# arch -> (tiles for head_dim <= 128, tiles for wider heads). sm90: 128 x 64 with one warpgroup and 3 stages,
# faster on every prefill/extend shape than 8 warps, 128-wide key tiles, 2 stages or 64-row tiles. sm80 (163 KiB) fits the same narrow tiles; sm86/sm89 and
# unknown GPUs (99 KiB) take 64-row tiles over 2 stages.
EXTEND_TILES = {
    "sm90": (ExtendConfig(128, 64, 4, 3), ExtendConfig(64, 32, 4, 2)),
    "sm80": (ExtendConfig(128, 64, 4, 3), ExtendConfig(64, 32, 4, 2)),
    "sm86": (ExtendConfig(64, 64, 4, 2), ExtendConfig(64, 32, 4, 2)),
    "sm89": (ExtendConfig(64, 64, 4, 2), ExtendConfig(64, 32, 4, 2)),
    "default": (ExtendConfig(64, 64, 4, 2), ExtendConfig(32, 32, 4, 2)),
}
INTERPRETER_EXTEND_TILES = ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def default_extend_config(head_dim: int, device: torch.device, target: GpuTarget | None = None) -> ExtendConfig:
    """The architecture's tiles on a GPU (`target`, default: the device's); small ones under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" and target is None:
        return INTERPRETER_EXTEND_TILES
    target = target or target_for(device)
    narrow, wide = EXTEND_TILES[target.arch]
    return wide if head_dim > 128 else narrow


def verify_extend_config(tokens: int, group: int, head_dim: int, device: torch.device) -> ExtendConfig:
    """Tiles for a speculative verify step: a few new tokens a request over a long cached prefix.

    The architecture's tiles waste most of their rows on q = 1 + K tokens; packing every query head of a KV
    head into one tile (tokens x group rows, at least 16, at most the default's) reads each request's keys
    once per KV head instead of once per query head.
    """
    base = default_extend_config(head_dim, device)
    rows = min(base.block_m, max(16, common.next_pow2(tokens * group)))
    return replace(base, block_m=rows, pack_gqa=True)


@triton.jit
def _kv_rows(ptrs, n_valid, col_mask, MASKED: tl.constexpr, PAD_D: tl.constexpr):
    """A key tile's K or V rows: a masked tile also drops keys past the request's end; a padded head dim
    masks its columns either way."""
    if MASKED:
        return tl.load(ptrs, mask=n_valid[:, None] & col_mask[None, :], other=0.0)
    if PAD_D:
        return tl.load(ptrs, mask=col_mask[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _extend_block(
    acc, m_i, l_i, q, n0, k_head, v_head, kv_indices, page_base, q_pos, seq, q_row, m_mask, Mask, mask_base,
    qk_scale_log2, sm_scale_k, softcap, window, stride_kt, stride_vt,
    offs_d, d_mask, offs_dv, dv_mask,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, PAD_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One key tile; k_head / v_head: the pool at the program's KV head. MASKED: a tile on the diagonal (or any
    tile with a window / custom mask)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_valid = offs_n < seq  # read by a masked tile only: every key of the others is in the request
    if MASKED:
        page = tl.load(kv_indices + page_base + offs_n // PAGE_SIZE, mask=n_valid, other=0)
    else:
        page = tl.load(kv_indices + page_base + offs_n // PAGE_SIZE)
    slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
    # [BLOCK_N, BLOCK_D]
    k = _kv_rows(k_head + slot[:, None] * stride_kt + offs_d[None, :], n_valid, d_mask, MASKED, PAD_D)
    s = common.dot_qk(q, k, DOT_F32)  # [BLOCK_M, BLOCK_N]
    visible = None
    if MASKED:
        visible = visible_keys(offs_n, n_valid, m_mask, q_row, q_pos, seq, Mask, mask_base, window,
                           HAS_WINDOW, HAS_CUSTOM_MASK)
    p, alpha, m_new, l_i = common.online_softmax_tile(s, visible, m_i, l_i, qk_scale_log2, sm_scale_k, softcap,
                                                      HAS_SOFTCAP, MASKED)
    # [BLOCK_N, BLOCK_DV]
    v = _kv_rows(v_head + slot[:, None] * stride_vt + offs_dv[None, :], n_valid, dv_mask, MASKED, PAD_D)
    acc = common.dot_pv(p, v, acc * alpha[:, None], q, DOT_F32)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q, K, V, Out, tile_req, tile_m0, qo_indptr, kv_indptr, kv_indices, seq_lens, Mask, mask_indptr, Sinks,
    qk_scale_log2, sm_scale_k, v_scale, softcap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr, DOT_F32: tl.constexpr,
):
    # PACK == 1: program_id(0) is a query head and rows are positions.
    # PACK == GROUP: program_id(0) is a KV head and row i is position i // PACK of head i % PACK.
    POSITIONS: tl.constexpr = BLOCK_M // PACK
    pid_h = tl.program_id(0)
    m0, q_start, ext, seq, prefix, page_base, mask_base = extend_tile(tile_req, tile_m0, qo_indptr, kv_indptr,
                                                                     seq_lens, mask_indptr, HAS_CUSTOM_MASK)
    kvh = pid_h * PACK // GROUP
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh

    rows = tl.arange(0, BLOCK_M)
    q_row = m0 + rows // PACK  # [BLOCK_M] position of each row among the request's new tokens
    head = pid_h * PACK + rows % PACK  # [BLOCK_M] query head of each row
    m_mask = (q_row < ext) & (rows < POSITIONS * PACK)
    q_pos = prefix + q_row  # [BLOCK_M] absolute positions of the rows' queries
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < V_DIM
    PAD_D: tl.constexpr = (BLOCK_D != HEAD_DIM) or (BLOCK_DV != V_DIM)
    q = tl.load(Q + (q_start + q_row)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)

    m_i, l_i, acc = common.online_softmax_start(BLOCK_M, BLOCK_DV)

    lo, full_end, hi = key_tile_range(prefix, m0, seq, window, POSITIONS, BLOCK_N, HAS_WINDOW, HAS_CUSTOM_MASK)
    for n0 in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _extend_block(
            acc, m_i, l_i, q, n0, k_head, v_head, kv_indices, page_base, q_pos, seq, q_row, m_mask, Mask, mask_base,
            qk_scale_log2, sm_scale_k, softcap, window, stride_kt, stride_vt, offs_d, d_mask, offs_dv, dv_mask,
            BLOCK_N, PAGE_SIZE, False, PAD_D, HAS_WINDOW, HAS_SOFTCAP, HAS_CUSTOM_MASK, DOT_F32)
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _extend_block(
            acc, m_i, l_i, q, n0, k_head, v_head, kv_indices, page_base, q_pos, seq, q_row, m_mask, Mask, mask_base,
            qk_scale_log2, sm_scale_k, softcap, window, stride_kt, stride_vt, offs_d, d_mask, offs_dv, dv_mask,
            BLOCK_N, PAGE_SIZE, True, PAD_D, HAS_WINDOW, HAS_SOFTCAP, HAS_CUSTOM_MASK, DOT_F32)

    if HAS_SINKS:
        sink = common.to_log2(tl.load(Sinks + head))
        l_i += tl.exp2(tl.minimum(sink - m_i, 126.0))  # capped: no overflow when nothing is visible
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None] * v_scale
    tl.store(Out + (q_start + q_row)[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             o.to(Out.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    rows: ExtendRows,
    layer: LayerParams,
    config: ExtendConfig | None = None,
    target: GpuTarget | None = None,
) -> torch.Tensor:
    """New tokens of every request against their whole paged KV (prefix + themselves).

    q `[T, Hq, D]`, out `[T, Hq, Dv]`; the pool buffers in their own layout; rows: the step's tiles, pages and
    masks (params.ExtendRows; a bool custom mask is read as uint8); layer: its scales and masking
    (params.LayerParams). `rows.tiles` must have been built with `config.positions_per_tile(group)` positions.
    `target` (default: q's GPU) picks the default tiles and bounds their shared memory.
    """
    tiles, qo_indptr, kv_indptr, kv_indices = rows.tiles, rows.qo_indptr, rows.kv_indptr, rows.kv_indices
    seq_lens, page_size, custom_mask, mask_indptr = rows.seq_lens, rows.page_size, rows.custom_mask, rows.mask_indptr
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, v_dim = k_buffer.shape[1], v_buffer.shape[-1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    target = target or target_for(q.device)

    def tile_shape(c: ExtendConfig) -> TileShape:
        return TileShape(c.block_m, common.next_pow2(head_dim), c.block_n,
                         common.next_pow2(head_dim) + common.next_pow2(v_dim), c.num_stages, q.element_size())

    config = settle_config("extend", config, default_extend_config(head_dim, q.device, target), tile_shape, target)
    group = num_heads // num_kv_heads
    pack = pack_factor(config, group)
    if tiles.positions != config.positions_per_tile(group):
        raise ValueError(f"tiles cover {tiles.positions} positions, the config's tiles "
                         f"{config.positions_per_tile(group)} (block_m={config.block_m}, pack={pack})")
    if num_tokens == 0 or tiles.num_tiles == 0:
        return out
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("custom_mask and mask_indptr must be given together")
    if custom_mask is not None and custom_mask.dtype == torch.bool:
        custom_mask = custom_mask.view(torch.uint8)
    _extend_kernel[(num_heads // pack, tiles.num_tiles)](
        q, k_buffer, v_buffer, out, tiles.tile_req, tiles.tile_m0, qo_indptr, kv_indptr, kv_indices, seq_lens,
        custom_mask if custom_mask is not None else q, mask_indptr if mask_indptr is not None else qo_indptr,
        layer.sinks if layer.sinks is not None else q,
        *common.layer_scalars(layer),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, PACK=pack, BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAGE_SIZE=page_size,
        HAS_CUSTOM_MASK=mask_kind(custom_mask, rows.mask_new_keys_only), DOT_F32=common.dot_dtype_is_f32(q),
        **common.layer_constexprs(layer, head_dim, v_dim),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


@dataclass
class ExpandedPrefillPlan:
    """One step's metadata for expanded MLA: the new tokens are their own KV, one page-size-1 "page" each."""

    qo_indptr: torch.Tensor  # [B+1] int32: tokens of request b are rows qo_indptr[b]:qo_indptr[b+1]
    token_slots: torch.Tensor  # [T] int32: 0..T-1, the page table that makes token t its own KV row
    extend_lens: torch.Tensor  # [B] int32: each request's KV length (its prompt)
    tiles: ExtendTiles
    config: ExtendConfig
    target: GpuTarget | None


def plan_expanded_prefill(extend_lens: list[int], qk_dim: int, device, config: ExtendConfig | None = None,
                          target: GpuTarget | None = None) -> ExpandedPrefillPlan:
    """Host-side plan, once per step (every layer of the model reuses it)."""
    device = torch.device(device)
    target = target or target_for(device)
    config = config or default_extend_config(qk_dim, device, target)
    indptr = [0]
    for n in extend_lens:
        indptr.append(indptr[-1] + n)
    return ExpandedPrefillPlan(
        qo_indptr=to_device(indptr, device, torch.int32),
        token_slots=torch.arange(indptr[-1], dtype=torch.int32, device=device),
        extend_lens=to_device(list(extend_lens), device, torch.int32),
        tiles=build_extend_tiles([0] * len(extend_lens), list(extend_lens), config.positions_per_tile(1), device),
        config=config,
        target=target,
    )


def expanded_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ExpandedPrefillPlan,
                         sm_scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of fresh prompts over their own expanded keys and values.

    q `[T, H, qk_dim]`, k `[T, H, qk_dim]` (nope + rope), v `[T, H, v_dim]` with v_dim <= qk_dim
    -> `[T, H, v_dim]`. The extend kernel reads k/v as a page-size-1 pool whose page table is 0..T-1.
    """
    num_tokens, num_heads, qk_dim = q.shape
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or v.shape[2] > qk_dim:
        raise ValueError(f"expanded MLA wants k {tuple(q.shape)} and v [{num_tokens}, {num_heads}, <= {qk_dim}], "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if plan.token_slots.numel() != num_tokens:
        raise ValueError(f"the plan covers {plan.token_slots.numel()} tokens, q has {num_tokens}")
    if out is None:
        out = q.new_empty(num_tokens, num_heads, v.shape[2])  # [T, H, v_dim]
    rows = ExtendRows(plan.tiles, plan.qo_indptr, plan.qo_indptr, plan.token_slots, plan.extend_lens, 1)
    return extend_attention(q, k, v, out, rows, LayerParams(sm_scale), config=plan.config, target=plan.target)
