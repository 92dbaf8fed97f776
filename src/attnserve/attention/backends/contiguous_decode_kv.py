"""The decode batch's K/V kept contiguous between steps, so a decode step appends one row instead of
gathering every request's whole history from the paged pool again.

torch has no paged attention kernel for the CPU; its fused SDPA wants K/V as dense `[B, Hkv, L, D]`.
Gathering that from the pool per layer per step copies all the K/V every step (through a 2-D advanced
index, far slower than appending one token). So the backend keeps, per layer, `[B, Hkv, cap, D]` copies of the running batch's K/V:

- rebuilt (one gather per layer, from the pool) when the batch changes: other rows, a length that is not
  last step's plus one, a step that was not a decode (a prefill chunk may have joined), or `cap` reached;
- otherwise appended: each request's new K/V row written at its position, the pool written as always.

A row can only change owner through an extend step (a new request is prefilled first), which drops
the copies when this backend also runs prefill; and the table must still hold, at every row's previous
position, the slot appended there last step. So "same rows, every length + 1, same slots" means the
same requests. The pool stays
the source of truth (radix cache, preemption); these copies are a cache of it for attention only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_MIRROR_BYTES = 1 << 30  # beyond this (big batches x long contexts) every step gathers instead of keeping copies
_CAP_STEP = 64


@dataclass
class ContiguousDecodeKV:
    rows: list[int]  # request rows, batch order
    lens: list[int]  # sequence lengths (this step's token included) the copies hold
    cap: int  # positions allocated per row
    keep: bool  # False: over MAX_MIRROR_BYTES, gather every step
    last_slots: torch.Tensor | None = None  # [B] pool slots of the newest rows held (checked before appending)
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, Hkv, cap, D]
    v: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [B, Hkv, cap, Dv]
    appending: bool = False  # this step appends to copies built in earlier steps


@dataclass
class DecodeStep:
    """What every layer of one decode step shares."""

    mirror: ContiguousDecodeKV
    slots: torch.Tensor | None  # [B * L] int64 pool slots (padding: slot 0), for rebuilding
    batch_index: torch.Tensor  # [B] int64: 0..B-1
    last_pos: torch.Tensor  # [B] int64: each request's new token's position
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, L] bool (True: visible) unless every request has the same length


def plan_decode_step(prev: ContiguousDecodeKV | None, fb, row_bytes: int, num_layers: int) -> DecodeStep:
    """This step's contiguous K/V (reused and appended to, or fresh) and the indices every layer needs."""
    rows = fb.req_pool_indices.tolist()
    lens = [int(x) for x in fb.seq_lens_cpu]
    max_len = max(lens, default=0)
    device = fb.req_pool_indices.device
    bs = len(rows)
    rows_t = fb.req_pool_indices.long()
    lens_t = torch.tensor(lens, device=device)
    if (prev is not None and prev.keep and prev.rows == rows and max_len <= prev.cap
            and all(n == p + 1 for n, p in zip(lens, prev.lens))
            and torch.equal(fb.req_to_token[rows_t, lens_t - 2].long(), prev.last_slots)):
        mirror = prev
        mirror.lens, mirror.appending = lens, True
        slots = None
    else:
        cap = -(-(max_len + max_len // 4 + 16) // _CAP_STEP) * _CAP_STEP
        keep = bs * cap * row_bytes * num_layers <= MAX_MIRROR_BYTES
        mirror = ContiguousDecodeKV(rows, lens, cap, keep)
        table = fb.req_to_token[rows_t, :max_len].long()  # [B, L]
        positions = torch.arange(max_len, device=device)
        slots = table.masked_fill(positions[None, :] >= lens_t[:, None], 0).reshape(-1)  # [B * L]
    mirror.last_slots = fb.out_cache_loc.long()
    mask = None
    if min(lens, default=0) != max_len:
        mask = (torch.arange(max_len, device=device)[None, :] < lens_t[:, None]).view(bs, 1, 1, max_len)
    return DecodeStep(mirror, slots, torch.arange(bs, device=device), lens_t - 1, max_len, mask)


def layer_kv(step: DecodeStep, pool, layer_id: int, k_new: torch.Tensor, v_new: torch.Tensor):
    """This layer's K `[B, Hkv, L, D]` and V `[B, Hkv, L, Dv]` (views into the contiguous copies) for the step.

    k_new / v_new `[B, Hkv, D]`: the step's new rows (already written to the pool)."""
    m = step.mirror
    k_buf, v_buf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    if m.appending and layer_id in m.k:
        k_m, v_m = m.k[layer_id], m.v[layer_id]
        k_m[step.batch_index, :, step.last_pos] = k_new
        v_m[step.batch_index, :, step.last_pos] = v_new
    else:
        slots = step.slots
        if slots is None:  # appending, but this layer's copies were never built (e.g. it took another path)
            raise RuntimeError("the contiguous decode K/V is missing a layer that the previous step built")
        bs, length = len(m.rows), step.max_len
        # zeros, not empty: a shorter request's positions past its length are masked, but a masked
        # probability 0 times a NaN left in uninitialised memory is still NaN
        k_m = k_buf.new_zeros(bs, k_buf.shape[1], m.cap, k_buf.shape[2])  # [B, Hkv, cap, D]
        v_m = v_buf.new_zeros(bs, v_buf.shape[1], m.cap, v_buf.shape[2])  # [B, Hkv, cap, Dv]
        k_m[:, :, :length] = k_buf.index_select(0, slots).view(bs, length, *k_buf.shape[1:]).transpose(1, 2)
        v_m[:, :, :length] = v_buf.index_select(0, slots).view(bs, length, *v_buf.shape[1:]).transpose(1, 2)
        if m.keep:
            m.k[layer_id], m.v[layer_id] = k_m, v_m
    return k_m[:, :, : step.max_len], v_m[:, :, : step.max_len]
