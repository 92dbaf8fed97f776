"""The expert alignment of ops/moe_align.py in one Triton launch instead of about fifteen torch ops.

At decode sizes the alignment's torch ops are each a few-microsecond launch around two GEMMs that read six
experts' weights in tens of microseconds; one program that counts, pads, places every pair and names each
block's expert does the same work in one launch. Spread over one program per expert (AlignLaunch.per_expert,
the shipped launches), each program counts every pair and places its own group; the single program walks every
group itself. Either walks the pairs in chunks, so its time grows with the pairs: large batches keep the torch
ops (fused_moe.py picks). Same outputs as the torch alignment, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import interpreting, next_pow2
from attnserve.attention.kernels.interpreter_compat import let_interpreter_index_with_loaded_scalars
from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor
from attnserve.ops.moe_align import ExpertAlignment, max_blocks


@dataclass(frozen=True)
class AlignLaunch:
    """How the alignment is launched: `chunk` pairs (and blocks) per step of the programs' loops, `fill_chunk`
    slots per step of the single program's padding fill (plain stores, so wider), `num_warps`; `per_expert`:
    one program per expert instead of one for everything (_align_per_expert_kernel)."""

    chunk: int = 64
    fill_chunk: int = 1024
    num_warps: int = 4
    per_expert: bool = False


# (most pairs, launch), first match. Measured on an H200 (benchmarks/moe_align_gpu.py, results/moe_align-h200.json,
# DeepSeek-V2-Lite's 64 + 2 experts, CUDA-graph replays): a program per expert wins at every size, one warp walking
# 32 pairs a step up to 4 tokens (2.1 us; the single program 3.0), four warps and 128 pairs from 16 tokens (2.7 us
# at 16 tokens, 5.7 at 64, 9.8 at 128; the single program's best 6.9, 16.2, 28.7)
LAUNCHES: tuple[tuple[int, AlignLaunch], ...] = (
    (32, AlignLaunch(chunk=32, num_warps=1, per_expert=True)),
    (1 << 62, AlignLaunch(chunk=128, num_warps=4, per_expert=True)),
)


def launch_for(num_pairs: int) -> AlignLaunch:
    return next(launch for most, launch in LAUNCHES if num_pairs <= most)


@triton.jit
def _pair_experts(Ids, offs, num_pairs, TOP_K: tl.constexpr, CHOICES: tl.constexpr, NUM_ROUTED: tl.constexpr,
                  E_PAD: tl.constexpr):
    """The expert of each pair id in offs: a routed choice from Ids, a shared expert past the top_k, E_PAD
    (no expert) past the last pair."""
    choice = offs % CHOICES
    routed = tl.load(Ids + (offs // CHOICES) * TOP_K + choice, mask=(offs < num_pairs) & (choice < TOP_K), other=0)
    e = tl.where(choice < TOP_K, routed.to(tl.int32), NUM_ROUTED + choice - TOP_K)
    return tl.where(offs < num_pairs, e, E_PAD)


@triton.jit
def _group_sizes(Ids, num_pairs, TOP_K: tl.constexpr, CHOICES: tl.constexpr, NUM_ROUTED: tl.constexpr,
                 E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Each expert's pairs `[E_PAD]`, and the rows its group takes once padded to whole row blocks."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        e = _pair_experts(Ids, p0 + tl.arange(0, CHUNK), num_pairs, TOP_K, CHOICES, NUM_ROUTED, E_PAD)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M


@triton.jit
def _align_kernel(
    Ids, SortedPairs, BlockExpert, num_pairs, num_blocks,
    TOP_K: tl.constexpr, CHOICES: tl.constexpr, NUM_ROUTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FILL_CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    experts = tl.arange(0, E_PAD)
    _, padded = _group_sizes(Ids, num_pairs, TOP_K, CHOICES, NUM_ROUTED, E_PAD, BLOCK_M, CHUNK)  # [E_PAD]
    padded_end = tl.cumsum(padded, axis=0)
    # each block's expert: how many groups end at or before its first row (E past the last group)
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        ended = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        tl.store(BlockExpert + blocks, tl.minimum(ended, NUM_EXPERTS), mask=blocks < num_blocks)
    for s0 in range(0, num_blocks * BLOCK_M, FILL_CHUNK):
        slots = s0 + tl.arange(0, FILL_CHUNK)
        tl.store(SortedPairs + slots, tl.zeros((FILL_CHUNK,), dtype=tl.int32) + num_pairs,
                 mask=slots < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding is written before any pair overwrites its slot
    cursor = padded_end - padded  # [E_PAD] the next free slot of each group
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        e = _pair_experts(Ids, offs, num_pairs, TOP_K, CHOICES, NUM_ROUTED, E_PAD)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        before = tl.cumsum(onehot, axis=0) - onehot  # this chunk's earlier pairs of the same expert
        slot = tl.sum((cursor[None, :] + before) * onehot, axis=1)  # [CHUNK]
        tl.store(SortedPairs + slot, offs, mask=offs < num_pairs)
        cursor += tl.sum(onehot, axis=0)


@triton.jit
def _align_per_expert_kernel(
    Ids, SortedPairs, BlockExpert, num_pairs, num_blocks,
    TOP_K: tl.constexpr, CHOICES: tl.constexpr, NUM_ROUTED: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """Program e < NUM_EXPERTS places expert e's group: every program counts all pairs by expert (the ids are a
    few KB), which gives its group's start; then it writes its own pairs in order, its group's padding and its
    blocks' expert. Program NUM_EXPERTS marks the blocks past the last group. The single program's work, spread
    over the experts, without any program waiting for another."""
    wait_for_predecessor(PDL)
    e = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts, padded = _group_sizes(Ids, num_pairs, TOP_K, CHOICES, NUM_ROUTED, E_PAD, BLOCK_M, CHUNK)  # [E_PAD]
    if e < NUM_EXPERTS:
        start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
        size = tl.sum(tl.where(experts == e, padded, 0), axis=0)
        used = tl.sum(tl.where(experts == e, counts, 0), axis=0)
        rows = tl.arange(0, BLOCK_M)  # the group's padding: fewer than BLOCK_M slots after its pairs
        tl.store(SortedPairs + start + used + rows, tl.zeros((BLOCK_M,), dtype=tl.int32) + num_pairs,
                 mask=used + rows < size)
        for b0 in range(0, size // BLOCK_M, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            tl.store(BlockExpert + start // BLOCK_M + blocks, tl.zeros((CHUNK,), dtype=tl.int32) + e,
                     mask=blocks < size // BLOCK_M)
        cursor = start
        for p0 in range(0, num_pairs, CHUNK):
            offs = p0 + tl.arange(0, CHUNK)
            mine = (_pair_experts(Ids, offs, num_pairs, TOP_K, CHOICES, NUM_ROUTED, E_PAD) == e).to(tl.int32)
            before = tl.cumsum(mine, axis=0) - mine  # this chunk's earlier pairs of the group
            tl.store(SortedPairs + cursor + before, offs, mask=mine != 0)
            cursor += tl.sum(mine, axis=0)
    else:  # the blocks past the last group: expert NUM_EXPERTS, every slot padding
        first = tl.sum(padded, axis=0) // BLOCK_M
        for b0 in range(first, num_blocks, CHUNK):
            blocks = b0 + tl.arange(0, CHUNK)
            tl.store(BlockExpert + blocks, tl.zeros((CHUNK,), dtype=tl.int32) + NUM_EXPERTS, mask=blocks < num_blocks)
            slots = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [CHUNK, BLOCK_M]
            tl.store(SortedPairs + slots, tl.zeros((CHUNK, BLOCK_M), dtype=tl.int32) + num_pairs,
                     mask=(blocks < num_blocks)[:, None])


def align_in_one_launch(ids: torch.Tensor, num_experts: int, block_m: int, num_shared: int = 0,
                         launch: AlignLaunch | None = None, pdl: bool = False) -> ExpertAlignment:
    """ids [T, top_k] -> ops.moe_align.align_by_expert's alignment (shared experts included), from one
    launch: one program, or one per expert (`launch`; by default the measured one for this size)."""
    tokens, top_k = ids.shape
    ids = ids.contiguous()
    num_pairs = tokens * (top_k + num_shared)
    experts = num_experts + num_shared
    blocks = max_blocks(num_pairs, experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)  # [blocks * block_m]
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)  # [blocks]
    if num_pairs:
        launch = launch or launch_for(num_pairs)
        if interpreting():
            let_interpreter_index_with_loaded_scalars()  # the loops' bounds are scalar arguments
        shape = {"TOP_K": top_k, "CHOICES": top_k + num_shared, "NUM_ROUTED": num_experts, "NUM_EXPERTS": experts,
                 "E_PAD": next_pow2(experts), "BLOCK_M": block_m, "CHUNK": launch.chunk, "num_warps": launch.num_warps}
        if launch.per_expert:
            _align_per_expert_kernel[(experts + 1,)](ids, sorted_pairs, block_expert, num_pairs, blocks, **shape,
                                                     **launch_options(pdl))
        else:
            _align_kernel[(1,)](ids, sorted_pairs, block_expert, num_pairs, blocks, **shape,
                                FILL_CHUNK=launch.fill_chunk, **launch_options(pdl))
    return ExpertAlignment(sorted_pairs, block_expert, block_m, num_pairs)
