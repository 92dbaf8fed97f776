"""Causal prefill / extend in Gluon on Hopper: the mask only on the diagonal, the softmax under the P.V MMA.

The Triton prefill (prefill_tma.py) leaves two things to Triton 3.6's warp specialisation, which does
neither: it builds the causal mask on every key tile (the pass takes one key loop, so the diagonal
cannot have its own), and it waits for each MMA before the softmax that follows, so the tensor cores
idle while the exponentials run (Nsight Compute on an H100 at 1 x 16384: 662 M ALU instructions and
the tensor pipe 62 % busy, against 241-278 M and 81-82 % for FA4 and FlashInfer's FA3 kernel). Gluon
states the schedule itself, as FlashAttention-3 lays it out:

- persistent: one program per SM walks prefill_tma's work list (query tiles heaviest first, heads fastest);
- a loader warpgroup (the default partition, 24 registers) brings both 64-row halves of each item's query
  tile into one of two buffers and the K and V tiles into two-slot rings, each slot with a ready and a
  free mbarrier, reloading a slot as soon as both consumers have read it;
- two consumer warpgroups (240 registers each) take 64 query rows each: every iteration issues
  S(j+1) = Q.K(j+1)^T and O += P(j).V(j) together, waits for the first only, and runs the softmax of
  S(j+1) while P(j).V(j) is still in the tensor cores (the intra-warpgroup overlap);
- the mask is applied only on tiles that cross a half's diagonal, behind a branch taken per tile.

Reads the same operands as prefill_tma (ragged contiguous K/V rows, the ExtendTiles work list), or, for a
call with a cached prefix, the KV pool's rows where they lie, through each request's slot list: an indirect
loader copies them with cp.async, as TMA cannot gather rows, and the backend no longer gathers every
request's keys first. Causal attention with head_dim 128 in bf16 or fp16 only, no window, soft-cap, sinks or
LSE (the caller keeps prefill_tma for those). Gluon does not run under the Triton interpreter:
tools/compile_prefill_gluon_sm90.py compiles it for sm_90 on any machine, and its GPU tests compare it with
the oracle.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnserve.attention.kernels.common import LOG2E
from attnserve.attention.kernels.extend_tiles import ExtendTiles
from attnserve.attention.kernels.mha.prefill_tma import tma_rows_ok
from attnserve.attention.kernels.params import LayerParams

BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64
BLOCK_N = 128  # keys per TMA tile
LOADER_WARPS = 4  # the default partition, which issues the TMA loads (one warpgroup: setmaxnreg works per group)
CONSUMER_REGS = 240  # registers of each consumer thread; the loader keeps what is left (FlashAttention-3's split)
# the indirect loader (cp.async) spills at the 24 registers left beside 240: at 224 it keeps 56, enough for
# INDIRECT_ROW_LANES = 8 (tools/compile_prefill_gluon_sm90.py --indirect: no spills, consumers included)
INDIRECT_CONSUMER_REGS = 224
# Loader lanes that copy one key row together, 16 bytes each, in the indirect loader: a warp's copy instruction reads
# 32 / INDIRECT_ROW_LANES rows, INDIRECT_ROW_LANES * 16 bytes of each, and a thread keeps the pool rows of
# 128 / (32 / INDIRECT_ROW_LANES * 4 warps) keys. Extend 8 x (4096 + 512) on an H100, the median of three rounds
# (sweep-prefill-gluon-indirect-h100-*.json): 1 lane 1,077 us, 2 lanes 742, 4 lanes 635, 8 lanes (whole 128-byte
# lines) 586, against 618 for the Gluon kernel on gathered rows; 16 lanes spill.
INDIRECT_ROW_LANES = 8
# slots of each of the K and V rings; with 2 the query tile is double-buffered (192 KiB of shared memory), with 3
# it is not (224 KiB, of Hopper's 227): 3 measured 0.99-1.00x (sweep-prefill-gluon-indirect-h100-5.json)
STAGES = 2
# The default takes this kernel for a call whose query tiles read at least this many key tiles on average: below
# it the per-tile start (the first S waited for, the last P.V, the store) outweighs the overlap, and prefill_tma is
# faster (H100, sweep-prefill-gluon-h100-{1,2}.json: 0.70x at 64x256 with 1.5 key tiles a query tile, 0.85-0.88x
# at 32x512 with 2.5, 0.97-0.99x at 16x1024 with 4.5; 1.03-1.05x at 8x2048 with 8.5, 1.03-1.26x on longer ones)
MIN_MEAN_KEY_TILES = 6
# The consumers taking turns to issue their MMAs (FlashAttention-3's ping-pong): correct on the GPU, and no faster
# (H100, two sweeps in both orders: 0.99-1.02x at 8x2048, 1.00x at 1x16384, 1.01-1.02x at extend, within the runs'
# noise; sweep-prefill-gluon-pingpong-h100-{1,2}.json), so off (tools/sweep_prefill_tma.py --gluon-set PINGPONG=1)
PINGPONG = False
# Items claimed as programs come free (an atomic counter the loader draws from; it tells the consumers which item
# through shared memory) instead of each program taking every 132nd: on the list's costs the static split leaves
# the busiest program 3.1% (prefill) to 7.5% (extend 8 x (4096 + 512)) over the mean, claiming 0.1-0.6% and 2.8%
# (docs/kernels.md). On an H100 (132 SMs) 1.012-1.015x at 1 x 16384 and 0.988-1.014x elsewhere, inside the noise
# (sweep-prefill-gluon-switches-h100-{3,5}.json): off, for parts with fewer SMs (bash benchmarks/h200.sh switches)
DYNAMIC_ITEMS = False
# A call with a cached prefix reads its keys where they lie in the pool (the indirect loader) instead of having
# them gathered into contiguous rows first; False brings the gather back
# (tools/sweep_prefill_tma.py --gluon-set READ_POOL_ROWS=0)
READ_POOL_ROWS = True


def gluon_prefill_supported(q: torch.Tensor, head_dim: int, layer: LayerParams, lse) -> str | None:
    """Why this kernel cannot serve the call (None: it can)."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "needs a Hopper GPU (sm_90)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (bf16 and fp16 only)"
    if head_dim != 128:
        return f"head_dim {head_dim} (128 only)"
    if layer.sliding_window is not None or layer.logit_cap is not None or layer.sinks is not None or lse is not None:
        return "a window, soft-cap, sinks or the LSE (prefill_tma has them)"
    return None


def mean_key_tiles(prefix_lens: list[int], extend_lens: list[int]) -> float:
    """Key tiles a query tile of the call reads, on average (causal: each tile reads up to its last row)."""
    tiles = keys = 0
    for p, e in zip(prefix_lens, extend_lens):
        for m0 in range(0, e, BLOCK_M):
            tiles += 1
            keys += -(-(p + min(m0 + BLOCK_M, e)) // BLOCK_N)
    return keys / tiles if tiles else 0.0


def short_tiles_blocker(mean: float) -> str | None:
    """Why the default keeps prefill_tma for a call whose query tiles read `mean` key tiles on average (None: the
    Gluon kernel is the faster one)."""
    if mean < MIN_MEAN_KEY_TILES:
        return f"{mean:.1f} key tiles a query tile, under {MIN_MEAN_KEY_TILES}: prefill_tma is faster"
    return None


@gluon.jit
def _softmax_tile(s, m_i, l_i, row_pos, n0, full_end, qk_scale_log2,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Scores s `[ROWS, BLOCK_N]` of the keys from n0 -> P, the rescale factor and the new running max and sum.

    Keys below full_end are visible to every row: only a tile reaching past it is masked (row_pos
    `[ROWS]`: each row's absolute position). The max is of raw scores (the scale is positive), so
    the exponent is one FMA per score."""
    if n0 + BLOCK_N > full_end:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))  # [BLOCK_N] offsets in the tile
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(row_pos - n0, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale_log2 - gl.expand_dims(m_new, 1))
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _work_item(w, num_work, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens,
               NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    """Work item w: the tile's request and rows, its head, the column of its KV head, and how many key tiles it
    reads (_item_tile, then _item_fields)."""
    r, m0, h = _item_tile(w, num_work, tile_req, tile_m0, NUM_HEADS, GROUP)
    return _item_fields(r, m0, h, qo_indptr, kv_starts, seq_lens, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM)


@gluon.jit
def _item_tile(w, num_work, tile_req, tile_m0, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr):
    """Work item w's query tile (its request r and first row m0) and head h. The list goes KV head by KV head,
    each one's query tiles heaviest first with its query heads fastest, so the programs running together read the
    keys of one KV head, which L2 holds: at 8 x 2048 on an H100, tile by tile over every head read 611 MB of
    DRAM, this order 206 MB, as FA3 and FA4 (201-203 MB: Q, K and V once), and it measured 1.01-1.03x
    (ncu-h100-gluon-kv-head-major-8x2048.json, sweep-prefill-gluon-switches-h100-1.json)."""
    per_kv_head = num_work // (NUM_HEADS // GROUP)
    t = w % per_kv_head // GROUP
    h = w // per_kv_head * GROUP + w % GROUP
    return gl.load(tile_req + t), gl.load(tile_m0 + t), h


@gluon.jit
def _item_fields(r, m0, h, qo_indptr, kv_starts, seq_lens, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The fields of the item at query tile (r, m0), head h: the request's offsets and lengths (loads at r)."""
    q_start = gl.load(qo_indptr + r)
    ext = gl.load(qo_indptr + r + 1) - q_start
    seq = gl.load(seq_lens + r)
    kv_start = gl.load(kv_starts + r)
    prefix = seq - ext
    n_tiles = gl.cdiv(gl.minimum(seq, prefix + m0 + BLOCK_M), BLOCK_N)  # nothing past the last row is visible
    return h, m0, q_start, ext, prefix, kv_start, h // GROUP * HEAD_DIM, n_tiles


@gluon.jit
def _load_query(q_desc, q_smem, q_ready, q_free, item_smem, done, w, h, m0, q_start, ext, prefix, n_tiles,
                BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, LOADER_WARPS: gl.constexpr,
                DYNAMIC_ITEMS: gl.constexpr):
    """Both 64-row halves of item w's query tile (head h) into the buffer of the done-th item, once the
    consumers have released it, and with DYNAMIC_ITEMS its fields beside it (_publish_item). With two buffers
    the next item's Q loads while this one runs (see STAGES)."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    Q_BUFFERS: gl.constexpr = q_free.shape[0]
    qb = done % Q_BUFFERS
    row = q_start + m0
    mbarrier.wait(q_free.index(qb), ((done // Q_BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
    if DYNAMIC_ITEMS:
        _publish_item(item_smem, done, w, h, m0, q_start, ext, prefix, n_tiles, LOADER_WARPS)
    mbarrier.expect(q_ready.index(qb), BLOCK_M * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(q_desc, [row, h * HEAD_DIM], q_ready.index(qb), q_smem.index(2 * qb))
    tma.async_copy_global_to_shared(q_desc, [row + HALF_M, h * HEAD_DIM], q_ready.index(qb), q_smem.index(2 * qb + 1))


ITEM_FIELDS = gl.constexpr(8)  # an item as the loader publishes it (DYNAMIC_ITEMS): w, h, m0, q_start, ext, prefix,
# n_tiles, unused


@gluon.jit
def _next_item(counter, w, DYNAMIC_ITEMS: gl.constexpr):
    """The item this program takes after w: the next unclaimed one of the list (DYNAMIC_ITEMS: every program
    took its program id's first, then claims from one counter, so a program that finished early takes more), or
    w + programs."""
    if DYNAMIC_ITEMS:
        return gl.atomic_add(counter, 1) + gl.num_programs(0)
    else:
        return w + gl.num_programs(0)


@gluon.jit
def _publish_item(item_smem, done, w, h, m0, q_start, ext, prefix, n_tiles, LOADER_WARPS: gl.constexpr):
    """The done-th item's fields into its query buffer's slot (w = num_work: no more items), written before that
    buffer's ready barrier is armed, which the consumers wait for before they read them."""
    Q_BUFFERS: gl.constexpr = item_smem.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [LOADER_WARPS], [0])  # one thread's whole row
    k = gl.arange(0, ITEM_FIELDS, layout=layout)
    fields = gl.where(k == 0, w, gl.where(k == 1, h, gl.where(k == 2, m0, gl.where(k == 3, q_start, gl.where(
        k == 4, ext, gl.where(k == 5, prefix, gl.where(k == 6, n_tiles, 0)))))))
    item_smem.index(done % Q_BUFFERS).store(fields)
    gl.thread_barrier()  # every loader thread's write before one thread arms the barrier


@gluon.jit
def _read_item(item_smem, q_ready, done):
    """The done-th item's fields, as _publish_item wrote them, once its query buffer is ready."""
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    qb = done % Q_BUFFERS
    mbarrier.wait(q_ready.index(qb), (done // Q_BUFFERS) & 1)
    layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [4], [0])  # every thread all of them
    fields = item_smem.index(qb).load(layout)
    k = gl.arange(0, ITEM_FIELDS, layout=layout)
    return (gl.sum(gl.where(k == 0, fields, 0), 0), gl.sum(gl.where(k == 1, fields, 0), 0),
            gl.sum(gl.where(k == 2, fields, 0), 0), gl.sum(gl.where(k == 3, fields, 0), 0),
            gl.sum(gl.where(k == 4, fields, 0), 0), gl.sum(gl.where(k == 5, fields, 0), 0),
            gl.sum(gl.where(k == 6, fields, 0), 0))


@gluon.jit
def _end_items(item_smem, q_ready, q_free, done, counter, num_work, LOADER_WARPS: gl.constexpr):
    """No item after the done-th: tell the consumers through the next query buffer (its ready barrier arrived on
    without a load), and, as the last program to get here, set the counter back to 0 for the next launch."""
    Q_BUFFERS: gl.constexpr = q_free.shape[0]
    qb = done % Q_BUFFERS
    mbarrier.wait(q_free.index(qb), ((done // Q_BUFFERS) & 1) ^ 1)
    _publish_item(item_smem, done, num_work, 0, 0, 0, 0, 0, 0, LOADER_WARPS)
    mbarrier.arrive(q_ready.index(qb), count=1)
    if gl.atomic_add(counter + 1, 1) == gl.num_programs(0) - 1:  # every program has claimed its last item
        gl.store(counter, 0)
        gl.store(counter + 1, 0)


@gluon.jit
def _tma_loader(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                item_smem, counter, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, num_work,
                NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
                DYNAMIC_ITEMS: gl.constexpr):
    """The producer over contiguous rows: for each of this program's work items, the query tile
    (_load_query), then its K and V tiles into their rings as slots come free (so the next item's first
    tiles arrive while the consumers finish this one)."""
    it = 0  # K/V tiles loaded so far: ring slot and phase
    done = 0  # work items loaded so far: the query buffer's phase
    w = gl.program_id(0)
    while w < num_work:
        h, m0, q_start, ext, prefix, kv_start, kv_col, n_tiles = _work_item(
            w, num_work, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, NUM_HEADS, GROUP, BLOCK_M, BLOCK_N,
            HEAD_DIM)
        _load_query(q_desc, q_smem, q_ready, q_free, item_smem, done, w, h, m0, q_start, ext, prefix, n_tiles,
                    BLOCK_M, HEAD_DIM, LOADER_WARPS, DYNAMIC_ITEMS)
        for i in range(n_tiles):
            slot = it % STAGES
            free_phase = ((it // STAGES) & 1) ^ 1
            row = kv_start + i * BLOCK_N
            mbarrier.wait(k_free.index(slot), free_phase)
            mbarrier.expect(k_ready.index(slot), BLOCK_N * HEAD_DIM * 2)
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(slot), k_ring.index(slot))
            mbarrier.wait(v_free.index(slot), free_phase)
            mbarrier.expect(v_ready.index(slot), BLOCK_N * HEAD_DIM * 2)
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(slot), v_ring.index(slot))
            it += 1
        done += 1
        w = _next_item(counter, w, DYNAMIC_ITEMS)
    if DYNAMIC_ITEMS:
        _end_items(item_smem, q_ready, q_free, done, counter, num_work, LOADER_WARPS)


@gluon.jit
def _tile_rows(request_slots, n0, seq, key_in_tile):
    """The pool rows of a request's keys n0 .. n0 + BLOCK_N (request_slots: its seq keys' rows; 0 past its end,
    where the copy reads nothing)."""
    key = n0 + key_in_tile
    return gl.load(request_slots + key, mask=key < seq, other=0)


@gluon.jit
def _copy_rows(tile, head, stride, rows, valid, cols):
    """cp.async of the key rows `rows` `[BLOCK_N]` (pool rows of one KV head at `head`) into `tile`; the rows not
    valid are zero-filled, not read."""
    offsets = gl.expand_dims(rows.to(gl.int64) * stride, 1) + cols  # [BLOCK_N, HEAD_DIM]
    async_copy.async_copy_global_to_shared(tile, head + offsets, mask=gl.expand_dims(valid, 1))


@gluon.jit
def _indirect_loader(q_desc, k_pool, v_pool, q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                     item_smem, counter, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, slots, stride_k, stride_v,
                     num_work, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
                     ROW_LANES: gl.constexpr, DYNAMIC_ITEMS: gl.constexpr):
    """_tma_loader for keys left where they are in the KV pool: request r's key n is pool row slots[kv_starts[r] + n].

    TMA cannot gather rows, so each K and V tile is copied with cp.async, ROW_LANES loader lanes a key row, 16
    bytes each (INDIRECT_ROW_LANES says why); every thread's arrival on the slot's ready barrier (init count:
    the loader's threads) fires once its copies have landed. Keys past the request's end are zero-filled, not
    read. A tile's pool rows are loaded while the loader still waits for its slots (the next tile's as soon
    as this one's copies are issued). The query tile still comes through TMA. This spares the call a gather
    of every request's keys into contiguous rows (two index_selects: 100 of 586 us at extend 8 x (4096 + 512)
    on an H100, ncu-h100-gluon-extend-8x4096512.json)."""
    # ROW_LANES lanes copy a key row together, 16 bytes each
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // ROW_LANES, ROW_LANES], [LOADER_WARPS, 1], [1, 0])
    key_in_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows_layout))  # [BLOCK_N]
    cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout)), 0)  # [1, HEAD_DIM]
    it = 0
    done = 0
    w = gl.program_id(0)
    while w < num_work:
        h, m0, q_start, ext, prefix, kv_start, kv_col, n_tiles = _work_item(
            w, num_work, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, NUM_HEADS, GROUP, BLOCK_M, BLOCK_N,
            HEAD_DIM)
        seq = prefix + ext
        k_head = k_pool + kv_col  # this item's KV head in every pool row
        v_head = v_pool + kv_col
        request_slots = slots + kv_start
        rows = _tile_rows(request_slots, 0, seq, key_in_tile)  # [BLOCK_N] int32
        _load_query(q_desc, q_smem, q_ready, q_free, item_smem, done, w, h, m0, q_start, ext, prefix, n_tiles,
                    BLOCK_M, HEAD_DIM, LOADER_WARPS, DYNAMIC_ITEMS)
        for i in range(n_tiles):
            slot = it % STAGES
            free_phase = ((it // STAGES) & 1) ^ 1
            valid = i * BLOCK_N + key_in_tile < seq
            mbarrier.wait(k_free.index(slot), free_phase)
            _copy_rows(k_ring.index(slot), k_head, stride_k, rows, valid, cols)
            async_copy.mbarrier_arrive(k_ready.index(slot), increment_count=False)
            mbarrier.wait(v_free.index(slot), free_phase)
            _copy_rows(v_ring.index(slot), v_head, stride_v, rows, valid, cols)
            async_copy.mbarrier_arrive(v_ready.index(slot), increment_count=False)
            rows = _tile_rows(request_slots, (i + 1) * BLOCK_N, seq, key_in_tile)  # the next tile's, read early
            it += 1
        done += 1
        w = _next_item(counter, w, DYNAMIC_ITEMS)
    if DYNAMIC_ITEMS:
        _end_items(item_smem, q_ready, q_free, done, counter, num_work, LOADER_WARPS)


@gluon.jit
def _loader(q_desc, k_src, v_src, q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free,
            item_smem, counter, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, slots, stride_k, stride_v, num_work,
            NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, ROW_LANES: gl.constexpr,
            INDIRECT: gl.constexpr, DYNAMIC_ITEMS: gl.constexpr):
    """The producer partition (the default one): K and V through TMA from contiguous rows, or (INDIRECT) copied
    from the pool's rows through the slot list."""
    if INDIRECT:
        _indirect_loader(q_desc, k_src, v_src, q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free,
                         v_free, item_smem, counter, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, slots,
                         stride_k, stride_v, num_work, NUM_HEADS, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         LOADER_WARPS, ROW_LANES, DYNAMIC_ITEMS)
    else:
        _tma_loader(q_desc, k_src, v_src, q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                    item_smem, counter, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, num_work, NUM_HEADS,
                    GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, LOADER_WARPS, DYNAMIC_ITEMS)


@gluon.jit
def _wait_ready(bar, phase, INDIRECT: gl.constexpr):
    """Wait for a K or V tile. cp.async (the indirect loader) writes shared memory through the generic proxy and
    wgmma reads it through the async one: a proxy fence orders the two (TMA writes through the async proxy)."""
    mbarrier.wait(bar, phase)
    if INDIRECT:
        fence_async_shared()


@gluon.jit
def _take_turn(turns, half: gl.constexpr, turn):
    """Wait until this consumer may issue its MMAs (its turn-th turn); the count of turns taken after it.

    turns: two mbarriers of one arrival each, one per consumer, which the other consumer arrives on when it
    hands over. A fresh barrier reads as phase 1 complete, so the first consumer's first wait passes."""
    mbarrier.wait(turns.index(half), (turn & 1) ^ (1 - half))
    return turn + 1


@gluon.jit
def _hand_over(turns, half: gl.constexpr):
    """This consumer's MMAs are issued: the other consumer's turn."""
    mbarrier.arrive(turns.index(1 - half), count=1)


@gluon.jit
def _first_scores(q_smem, k_ring, q_ready, k_ready, turns, zero_s, it, done, turn, half: gl.constexpr,
                  STAGES: gl.constexpr, PINGPONG: gl.constexpr, INDIRECT: gl.constexpr, has_item=True):
    """Issue the done-th item's first S = Q.K^T (its query tile in that item's buffer, the key tile at ring
    position `it`) without waiting for it; its token and the turns taken after it (PINGPONG).

    has_item False (past a program's last item): the MMA is issued all the same, on whatever the buffers
    hold, and its result never read; only the waits are skipped. An MMA under a branch would carry its
    accumulator out of the branch, and ptxas then serialises every wgmma of the kernel."""
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    qb = done % Q_BUFFERS
    slot = it % STAGES
    if has_item:
        mbarrier.wait(q_ready.index(qb), (done // Q_BUFFERS) & 1)
        _wait_ready(k_ready.index(slot), (it // STAGES) & 1, INDIRECT)
    if PINGPONG:
        turn = _take_turn(turns, half, turn)
    s_tok = warpgroup_mma(q_smem.index(2 * qb + half), k_ring.index(slot).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    if PINGPONG:
        _hand_over(turns, half)
    return s_tok, turn


@gluon.jit
def _consume_item(s_tok, zero_s, prefix, m0, n_tiles, it, done, turn, half: gl.constexpr, q_smem, k_ring, v_ring,
                  q_free, k_ready, v_ready, k_free, v_free, turns, qk_scale_log2, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, INDIRECT: gl.constexpr):
    """One work item of a consumer (see _consumer) from its first S (_first_scores, in flight) to its last P.V,
    issued and not waited for: its n_tiles key tiles from ring position `it`, its query tile in the buffer of the
    done-th item; zero_s the consumer's zero score tile, in the scores' layout. Returns the last P.V's token, the
    rows' softmax sums and the turns taken after it (PINGPONG)."""
    HALF_M: gl.constexpr = q_smem.shape[1]
    Q_BUFFERS: gl.constexpr = q_free.shape[0]
    s_layout: gl.constexpr = zero_s.type.layout
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P from registers
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    first = prefix + m0 + half * HALF_M  # the absolute position of this warpgroup's first row
    row_pos = first + gl.arange(0, HALF_M, layout=row_layout)  # [HALF_M]
    full_end = first + 1  # keys below it are visible to every row of the half
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([HALF_M], -1.0e30, gl.float32, row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, row_layout)

    qb = done % Q_BUFFERS
    q_half = q_smem.index(2 * qb + half)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(k_free.index(it % STAGES), count=1)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, row_pos, 0, full_end, qk_scale_log2, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(0, n_tiles - 1):
        slot = (it + j) % STAGES
        nslot = (it + j + 1) % STAGES
        _wait_ready(k_ready.index(nslot), ((it + j + 1) // STAGES) & 1, INDIRECT)
        if PINGPONG:
            _wait_ready(v_ready.index(slot), ((it + j) // STAGES) & 1, INDIRECT)
            turn = _take_turn(turns, half, turn)
        s_tok = warpgroup_mma(q_half, k_ring.index(nslot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if not PINGPONG:
            _wait_ready(v_ready.index(slot), ((it + j) // STAGES) & 1, INDIRECT)
        o_tok = warpgroup_mma(p_op, v_ring.index(slot), acc, is_async=True)
        if PINGPONG:
            _hand_over(turns, half)
        s = warpgroup_mma_wait(1, deps=[s_tok])  # S(j+1) done; P(j).V(j) still running
        mbarrier.arrive(k_free.index(nslot), count=1)
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, row_pos, (j + 1) * BLOCK_N, full_end, qk_scale_log2,
                                           BLOCK_N, s_layout)
        # P(j)'s registers are left out of the wait: named there one 16-bit value at a time, they kept ptxas from
        # packing them, and it swapped halves back before each MMA (32 PRMT a key step). Nothing rewrites them
        # before the wait (tools/compile_prefill_gluon_sm90.py: wgmma_operand_rewrites); 590 SASS
        # instructions a key step against 624, and 1.00-1.03x (sweep-prefill-gluon-switches-h100-1.json)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(v_free.index(slot), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.arrive(q_free.index(qb), count=1)  # this item's scores are done: its query buffer is free
    last = it + n_tiles - 1
    _wait_ready(v_ready.index(last % STAGES), (last // STAGES) & 1, INDIRECT)
    if PINGPONG:
        turn = _take_turn(turns, half, turn)
    o_tok = warpgroup_mma(p_op, v_ring.index(last % STAGES), acc, is_async=True)
    if PINGPONG:
        _hand_over(turns, half)
    return o_tok, l_i, turn


@gluon.jit
def _finish_item(acc, l_i, v_free, last, Out, h, m0, q_start, ext, stride_ot, stride_oh, half: gl.constexpr,
                 STAGES: gl.constexpr):
    """The item's output once its last P.V (ring position `last`) is done: that V slot released, the rows
    normalised and stored."""
    HALF_M: gl.constexpr = acc.shape[0]
    HEAD_DIM: gl.constexpr = acc.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    mbarrier.arrive(v_free.index(last % STAGES), count=1)
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    # one reciprocal a row and a multiply: dividing each element took about 4 instructions (an approximate
    # division and its range checks), 64 a thread, here, where neither consumer keeps the tensor cores busy
    o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout)), 1)
    rows = m0 + half * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))  # among the new tokens
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))  # [HEAD_DIM]
    ptrs = Out + gl.expand_dims((q_start + rows) * stride_ot + h * stride_oh, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, o.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < ext, 1))


@gluon.jit
def _consumer(q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free, turns, item_smem, Out,
              tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, num_work, half: gl.constexpr, qk_scale_log2,
              stride_ot, stride_oh, NUM_HEADS: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
              INDIRECT: gl.constexpr, DYNAMIC_ITEMS: gl.constexpr):
    """One warpgroup's 64 query rows of each work item: S(j+1) = Q.K(j+1)^T and O += P(j).V(j) in flight
    together, the softmax of S(j+1) while the second runs; each ring slot released (one arrival of the two
    consumers') once read. With PINGPONG the two consumers take turns to issue their MMAs (the first
    consumer first; each hands the turn over as soon as its MMAs are issued), so one's softmax runs
    under the other's MMAs (FlashAttention-3's warpgroup ping-pong, ordered through mbarriers, as Gluon
    has no named barriers). Every wait for data comes before the wait for the turn: a consumer holding
    the turn waits only for the tensor cores. With DYNAMIC_ITEMS the loader says which item comes next
    (_publish_item), and the consumers read it beside the item's query tile.

    The next item's first S is issued right after this item's last P.V, which alone is waited for (wgmma groups
    complete in order), so the S runs while this item's rows are normalised and stored: both consumers reach an
    item's end together, and the tensor pipe had nothing from either from the last P.V to the next item's first
    S. 1.00-1.01x on fresh prompts and 1.02-1.04x at extend in four sweeps
    (sweep-prefill-gluon-switches-h100-{3,4,5,6}.json)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    zero_s = gl.zeros([BLOCK_M // 2, BLOCK_N], gl.float32, s_layout)
    it = 0  # K/V tiles consumed so far: ring slot and phase
    done = 0  # work items finished: the query buffer's phase
    turn = 0  # turns taken (PINGPONG): the first consumer's first turn is free, the second's waits for it
    if DYNAMIC_ITEMS:
        w, h, m0, q_start, ext, prefix, n_tiles = _read_item(item_smem, q_ready, done)
        s_tok, turn = _first_scores(q_smem, k_ring, q_ready, k_ready, turns, zero_s, it, done, turn, half, STAGES,
                                    PINGPONG, INDIRECT, w < num_work)
        while w < num_work:
            o_tok, l_i, turn = _consume_item(s_tok, zero_s, prefix, m0, n_tiles, it, done, turn, half, q_smem,
                                             k_ring, v_ring, q_free, k_ready, v_ready, k_free, v_free, turns,
                                             qk_scale_log2, BLOCK_N, HEAD_DIM, STAGES, PINGPONG, INDIRECT)
            last = it + n_tiles - 1
            it += n_tiles
            done += 1
            item_h, item_m0, item_q_start, item_ext = h, m0, q_start, ext
            w, h, m0, q_start, ext, prefix, n_tiles = _read_item(item_smem, q_ready, done)
            s_tok, turn = _first_scores(q_smem, k_ring, q_ready, k_ready, turns, zero_s, it, done, turn, half,
                                        STAGES, PINGPONG, INDIRECT, w < num_work)
            acc = warpgroup_mma_wait(1, deps=[o_tok])  # the last P.V done; the next S still running
            _finish_item(acc, l_i, v_free, last, Out, item_h, item_m0, item_q_start, item_ext, stride_ot,
                         stride_oh, half, STAGES)
        warpgroup_mma_wait(0, deps=[s_tok])  # the S issued past the last item
        return
    # A work item's fields are read ahead, its tile (request and rows) two items ahead and the request's offsets
    # and lengths one item ahead, so no load waits for another: read at the item's start, the second load's
    # address waited for the first (an L2 round trip) before the item's first MMA. With the reciprocal below,
    # 1.02-1.06x on fresh prompts (sweep-prefill-gluon-switches-h100-2.json)
    item = _work_item(gl.program_id(0), num_work, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, NUM_HEADS,
                      GROUP, BLOCK_M, BLOCK_N, HEAD_DIM)
    tile = _item_tile(gl.minimum(gl.program_id(0) + gl.num_programs(0), num_work - 1), num_work, tile_req, tile_m0,
                      NUM_HEADS, GROUP)
    # the grid has no more programs than items: each program has a first one
    s_tok, turn = _first_scores(q_smem, k_ring, q_ready, k_ready, turns, zero_s, it, done, turn, half, STAGES,
                                PINGPONG, INDIRECT)
    for w in range(gl.program_id(0), num_work, gl.num_programs(0)):
        h, m0, q_start, ext, prefix, kv_start, kv_col, n_tiles = item
        item = _item_fields(tile[0], tile[1], tile[2], qo_indptr, kv_starts, seq_lens, GROUP, BLOCK_M, BLOCK_N,
                            HEAD_DIM)
        tile = _item_tile(gl.minimum(w + 2 * gl.num_programs(0), num_work - 1), num_work, tile_req, tile_m0,
                          NUM_HEADS, GROUP)
        o_tok, l_i, turn = _consume_item(s_tok, zero_s, prefix, m0, n_tiles, it, done, turn, half, q_smem, k_ring,
                                         v_ring, q_free, k_ready, v_ready, k_free, v_free, turns, qk_scale_log2,
                                         BLOCK_N, HEAD_DIM, STAGES, PINGPONG, INDIRECT)
        last = it + n_tiles - 1
        it += n_tiles
        done += 1
        s_tok, turn = _first_scores(q_smem, k_ring, q_ready, k_ready, turns, zero_s, it, done, turn, half, STAGES,
                                    PINGPONG, INDIRECT, w + gl.num_programs(0) < num_work)
        acc = warpgroup_mma_wait(1, deps=[o_tok])  # the last P.V done; the next S still running
        _finish_item(acc, l_i, v_free, last, Out, h, m0, q_start, ext, stride_ot, stride_oh, half, STAGES)
    warpgroup_mma_wait(0, deps=[s_tok])  # the S issued past the last item


@gluon.jit(do_not_specialize=("num_work",))  # a step's work count: no variant per divisibility (prefill_tma's reason)
def _prefill_gluon_kernel(
    q_desc, k_src, v_src, Out, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, slots,
    qk_scale_log2, stride_ot, stride_oh, stride_k, stride_v, num_work, counter,
    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
    INDIRECT: gl.constexpr, KV_LAYOUT: gl.constexpr, LOADER_WARPS: gl.constexpr, ROW_LANES: gl.constexpr,
    DYNAMIC_ITEMS: gl.constexpr = False,
):
    # FlashAttention-3's layout, persistent: one program per SM walks the (query tile, head) work list; this
    # program's warps (the default partition) load, two consumer warpgroups take 64 query rows each of every
    # tile and share the K/V rings. k_src / v_src: TMA descriptors over contiguous rows, or (INDIRECT) the pool's
    # `[slots, Hkv, D]` buffers, read row by row through `slots`
    HALF_M: gl.constexpr = BLOCK_M // 2
    GROUP: gl.constexpr = NUM_HEADS // NUM_KV_HEADS
    Q_BUFFERS: gl.constexpr = 2 if STAGES == 2 else 1  # (see STAGES); the partitions read it off q_ready, q_free
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFFERS, HALF_M, HEAD_DIM], q_desc.layout)  # buffers of 2 halves
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=2)  # one arrival from each consumer
    if PINGPONG:  # the consumers' turns, one barrier a consumer
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)
    else:  # unused: the consumers take the same arguments either way
        turns = q_ready
    if DYNAMIC_ITEMS:  # each query buffer's item, as the loader claimed it
        item_smem = gl.allocate_shared_memory(gl.int32, [Q_BUFFERS, ITEM_FIELDS],
                                              gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    else:
        item_smem = q_ready
    # a tile is ready on the TMA's one arrival and its bytes, or on every loader thread's cp.async arrival
    READY_ARRIVALS: gl.constexpr = LOADER_WARPS * 32 if INDIRECT else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(v_ready.index(i), count=READY_ARRIVALS)
        mbarrier.init(k_free.index(i), count=2)
        mbarrier.init(v_free.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_loader, (q_desc, k_src, v_src, q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                   item_smem, counter, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, slots, stride_k, stride_v,
                   num_work, NUM_HEADS, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, LOADER_WARPS, ROW_LANES, INDIRECT,
                   DYNAMIC_ITEMS)),
        (_consumer, (q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free, turns, item_smem,
                     Out, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, num_work, 0, qk_scale_log2, stride_ot,
                     stride_oh, NUM_HEADS, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PINGPONG, INDIRECT,
                     DYNAMIC_ITEMS)),
        (_consumer, (q_smem, k_ring, v_ring, q_ready, q_free, k_ready, v_ready, k_free, v_free, turns, item_smem,
                     Out, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, num_work, 1, qk_scale_log2, stride_ot,
                     stride_oh, NUM_HEADS, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PINGPONG, INDIRECT,
                     DYNAMIC_ITEMS)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


_ITEM_COUNTERS: dict[int, torch.Tensor] = {}


def item_counter(device: torch.device) -> torch.Tensor:
    """`[2]` int32 on the device, zero between launches: the items claimed and the programs finished (DYNAMIC_ITEMS).
    Each launch sets it back to zero as its last program ends, so one buffer serves every launch on the device's
    stream, a CUDA graph's replays included; launches running at once on two streams would share it."""
    index = torch.device(device).index or 0
    if index not in _ITEM_COUNTERS:
        _ITEM_COUNTERS[index] = torch.zeros(2, dtype=torch.int32, device=device)
    return _ITEM_COUNTERS[index]


def _shared_layout(dtype: torch.dtype, block_rows: int, dim: int):
    """The swizzled shared layout wgmma reads a `[block_rows, dim]` tile in (and TMA writes it in)."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, dim], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


def _descriptor(rows: torch.Tensor, block_rows: int):
    """A host descriptor over `[rows, heads * dim]` whose blocks are `block_rows` rows of one head."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, heads, dim = rows.shape
    return TensorDescriptor(rows, [n, heads * dim], [rows.stride(0), 1], [block_rows, dim],
                            _shared_layout(rows.dtype, block_rows, dim))


def prefill_gluon_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, kv_starts: torch.Tensor,
                            out: torch.Tensor, tiles: ExtendTiles, qo_indptr: torch.Tensor, seq_lens: torch.Tensor,
                            layer: LayerParams, pingpong: bool | None = None,
                            slots: torch.Tensor | None = None) -> torch.Tensor:
    """prefill_tma_attention's contract (q `[T, Hq, D]`, K/V rows `[rows, Hkv, D]`, request r's keys at rows
    kv_starts[r] .. + seq_lens[r], `tiles` of 128 positions) for causal attention at head_dim 128.
    pingpong: the consumers take turns to issue their MMAs (None: the module's PINGPONG).
    slots: `[rows]` int32, request r's key n at K/V row slots[kv_starts[r] + n] (prefill_tma.request_slots): the
    keys are read where they lie, the KV pool's `[slots, Hkv, D]` buffers, instead of gathered first."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_rows.shape[1]
    why = gluon_prefill_supported(q, head_dim, layer, None)
    if why:
        raise ValueError(f"the Gluon prefill cannot run this call: {why}")
    if tiles.positions != BLOCK_M:
        raise ValueError(f"tiles cover {tiles.positions} positions, the kernel's {BLOCK_M}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    # TMA's layout rules are the indirect loader's too: heads adjacent in a row, rows 16-byte aligned
    for name, t in (("q", q), ("k_rows", k_rows), ("v_rows", v_rows)):
        if not tma_rows_ok(t) or t.dtype != q.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} with strides {t.stride()} cannot be read as rows "
                             f"of 16-byte-aligned heads beside q's {q.dtype}")
    if slots is not None and slots.dtype != torch.int32:
        raise ValueError(f"slots must be int32, not {slots.dtype}")
    if num_tokens == 0 or tiles.num_tiles == 0:
        return out
    num_work = num_heads * tiles.num_tiles
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    indirect = slots is not None
    k_src, v_src = (k_rows, v_rows) if indirect else (_descriptor(k_rows, BLOCK_N), _descriptor(v_rows, BLOCK_N))
    _prefill_gluon_kernel[(min(num_work, sms),)](
        _descriptor(q, BLOCK_M // 2), k_src, v_src, out,
        tiles.tile_req, tiles.tile_m0, qo_indptr, kv_starts, seq_lens, slots if indirect else kv_starts,
        layer.sm_scale * LOG2E, out.stride(0), out.stride(1), k_rows.stride(0), v_rows.stride(0), num_work,
        item_counter(q.device),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
        STAGES=STAGES, CONSUMER_REGS=INDIRECT_CONSUMER_REGS if indirect else CONSUMER_REGS,
        PINGPONG=PINGPONG if pingpong is None else pingpong, INDIRECT=indirect, ROW_LANES=INDIRECT_ROW_LANES,
        KV_LAYOUT=_shared_layout(q.dtype, BLOCK_N, head_dim), LOADER_WARPS=LOADER_WARPS,
        DYNAMIC_ITEMS=DYNAMIC_ITEMS, num_warps=LOADER_WARPS,
    )
    return out
