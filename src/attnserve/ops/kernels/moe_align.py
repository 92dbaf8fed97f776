"""The expert alignment of ops/moe_align.py in one Triton program: one launch instead of about fifteen.

At decode sizes the alignment's torch ops are each a few-microsecond launch around two GEMMs that read six
experts' weights in tens of microseconds; one program that counts, pads, places every pair and names each
block's expert does the same work in one launch. It walks the pairs in chunks, so its time grows with the
pairs: large batches keep the torch ops (fused_moe.py picks). Same outputs as the torch alignment, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import next_pow2
from attnserve.ops.moe_align import ExpertAlignment, max_blocks

CHUNK = 64  # pairs (and blocks, and padded slots) per step of the program's loops


@triton.jit
def _align_kernel(
    Ids, SortedPairs, BlockExpert, num_pairs, num_blocks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        e = tl.load(Ids + offs, mask=offs < num_pairs, other=E_PAD).to(tl.int32)  # E_PAD: no expert
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    padded_end = tl.cumsum(padded, axis=0)
    # each block's expert: how many groups end at or before its first row (E past the last group)
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        ended = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        tl.store(BlockExpert + blocks, tl.minimum(ended, NUM_EXPERTS), mask=blocks < num_blocks)
    for s0 in range(0, num_blocks * BLOCK_M, CHUNK):
        slots = s0 + tl.arange(0, CHUNK)
        tl.store(SortedPairs + slots, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs,
                 mask=slots < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding is written before any pair overwrites its slot
    cursor = padded_end - padded  # [E_PAD] the next free slot of each group
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        e = tl.load(Ids + offs, mask=offs < num_pairs, other=E_PAD).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        before = tl.cumsum(onehot, axis=0) - onehot  # this chunk's earlier pairs of the same expert
        slot = tl.sum((cursor[None, :] + before) * onehot, axis=1)  # [CHUNK]
        tl.store(SortedPairs + slot, offs, mask=offs < num_pairs)
        cursor += tl.sum(onehot, axis=0)


def align_in_one_program(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """ids [T, top_k] -> ops.moe_align.align_by_expert's alignment, from one single-program launch."""
    flat = ids.reshape(-1).contiguous()  # [P]
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)  # [blocks * block_m]
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)  # [blocks]
    if num_pairs:
        _align_kernel[(1,)](flat, sorted_pairs, block_expert, num_pairs, blocks, NUM_EXPERTS=num_experts,
                            E_PAD=next_pow2(num_experts), BLOCK_M=block_m, CHUNK=CHUNK, num_warps=4)
    return ExpertAlignment(sorted_pairs, block_expert, block_m, num_pairs)
