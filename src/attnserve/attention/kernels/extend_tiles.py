"""Extend tiles both extend families share: the host's work list of query tiles, and which keys a tile sees.

A tile is `positions` consecutive new tokens of one request (for MHA, of one KV head's query group); the list
runs heaviest first so the longest tiles start in the first wave. `key_tile_range` bounds the key tiles a query
tile visits, `visible_keys` masks a key tile: causal or a custom mask (over every key, or over the new tokens
only), then the sliding window. `extend_tile` reads what a program needs of its tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.transfers import to_device


@dataclass
class ExtendTiles:
    """Work list for the extend grid: tile t covers new-token positions tile_m0[t]:+positions of tile_req[t]."""

    tile_req: torch.Tensor  # [num_tiles] int32
    tile_m0: torch.Tensor  # [num_tiles] int32
    positions: int

    @property
    def num_tiles(self) -> int:
        return self.tile_req.numel()


def build_extend_tiles(prefix_lens: list[int], extend_lens: list[int], positions: int, device) -> ExtendTiles:
    """Host-side tile list of `positions` query positions each, heaviest (most keys to sweep) first."""
    tiles = []
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        for m0 in range(0, e, positions):
            tiles.append((p + min(m0 + positions, e), r, m0))
    tiles.sort(key=lambda x: -x[0])
    device = torch.device(device)
    # one copy through pinned memory: a copy from pageable memory may wait for the step in flight
    both = to_device([[t[1] for t in tiles], [t[2] for t in tiles]], device, torch.int32)  # [2, num_tiles]
    return ExtendTiles(both[0], both[1], positions)


# what a custom mask covers (the kernels' HAS_CUSTOM_MASK constexpr): none (causal), every key of the request
# (per request [ext, seq]), or only the new tokens (per request [ext, ext], the cached prefix visible to every row:
# speculative verify's tree mask, whose size does not depend on the prefix, so a CUDA graph can keep it in place)
NO_MASK, MASK_ALL_KEYS, MASK_NEW_KEYS = 0, 1, 2


def mask_kind(custom_mask, covers_new_keys_only: bool) -> int:
    """The HAS_CUSTOM_MASK value of a launch with this mask."""
    if custom_mask is None:
        return NO_MASK
    return MASK_NEW_KEYS if covers_new_keys_only else MASK_ALL_KEYS


@triton.jit
def visible_keys(offs_n, n_valid, m_mask, q_row, q_pos, seq, Mask, mask_base, window,
             HAS_WINDOW: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr):
    """[BLOCK_M, BLOCK_N] which keys each row may see: causal or the custom mask, then the window."""
    visible = n_valid[None, :] & m_mask[:, None]
    if HAS_CUSTOM_MASK == 2:  # MASK_NEW_KEYS
        prefix = q_pos - q_row  # [BLOCK_M], the same on every row
        col = offs_n[None, :] - prefix[:, None]  # [BLOCK_M, BLOCK_N] key index among the new tokens
        new_key = col >= 0
        bits = tl.load(Mask + mask_base + q_row[:, None] * (seq - prefix)[:, None] + col,
                       mask=visible & new_key, other=0)
        visible = visible & ((col < 0) | (bits != 0))
    elif HAS_CUSTOM_MASK:
        bits = tl.load(Mask + mask_base + q_row[:, None] * seq + offs_n[None, :], mask=visible, other=0)
        visible = visible & (bits != 0)
    else:
        visible = visible & (offs_n[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
    return visible


@triton.jit
def extend_tile(tile_req, tile_m0, qo_indptr, kv_indptr, seq_lens, mask_indptr, HAS_CUSTOM_MASK: tl.constexpr):
    """The tile of program_id(1) in the host's list: (m0 its first row among the request's new tokens, q_start
    the request's first query row, ext its new tokens, seq its keys, prefix, page_base its first kv_indices
    entry, mask_base its custom mask's offset)."""
    t = tl.program_id(1)
    r = tl.load(tile_req + t)
    q_start = tl.load(qo_indptr + r)
    ext = tl.load(qo_indptr + r + 1) - q_start
    seq = tl.load(seq_lens + r)
    mask_base = 0
    if HAS_CUSTOM_MASK:
        mask_base = tl.load(mask_indptr + r)
    return tl.load(tile_m0 + t), q_start, ext, seq, seq - ext, tl.load(kv_indptr + r), mask_base


@triton.jit
def key_tile_range(prefix, m0, seq, window, POSITIONS: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr):
    """Key tiles a query tile visits: [lo, full_end) need no mask, [full_end, hi) do.

    The rows are positions prefix + m0 .. prefix + m0 + POSITIONS - 1 of a request of `seq` keys.
    """
    if HAS_CUSTOM_MASK:
        hi = seq
    else:
        hi = tl.minimum(seq, prefix + m0 + POSITIONS)  # past the last row's position nothing is visible
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    if HAS_WINDOW or HAS_CUSTOM_MASK == 1:  # MASK_ALL_KEYS
        full_end = lo
    elif HAS_CUSTOM_MASK == 2:  # MASK_NEW_KEYS
        full_end = prefix // BLOCK_N * BLOCK_N  # tiles wholly inside the prefix, which every row sees
    else:
        full_end = (prefix + m0 + 1) // BLOCK_N * BLOCK_N  # tiles wholly at or before the first row
    return lo, full_end, hi
