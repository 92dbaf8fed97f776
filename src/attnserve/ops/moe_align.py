"""Token-to-expert sort and align for the fused MoE kernel: (token, choice) pairs grouped by expert, each
expert's group padded to a whole number of row blocks, so that every block of a grouped GEMM belongs to one
expert and reads that expert's weights alone.

Every buffer's size depends on the number of pairs and the block size, never on the routing, and nothing is
read back to the host: the alignment can be captured in a CUDA graph and replayed for any routing. Plain torch
(the CPU runs it, and it is the oracle of any faster alignment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertAlignment:
    """sorted_pairs [max_blocks * block_m] int32: pair ids (token * top_k + choice) grouped by expert, each group
    padded with `num_pairs` (a pair id that does not exist) to a multiple of block_m;
    block_expert [max_blocks] int32: each row block's expert, `num_experts` for the blocks past the last group."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most row blocks any routing of `num_pairs` pairs can need: each expert used pads at most
    block_m - 1 rows, and at most min(E, pairs) experts are used. One token over top-6: six blocks."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, num_shared: int = 0) -> ExpertAlignment:
    """ids [T, top_k] expert ids -> the pairs sorted by expert (stable: a group keeps token order), padded.

    num_shared: every token also takes the shared experts E .. E + S - 1 as its last choices (a pair is then
    token * (top_k + S) + choice), and the blocks past the last group are E + S's."""
    if num_shared:
        shared = torch.arange(num_experts, num_experts + num_shared, device=ids.device)  # [S]
        ids = torch.cat((ids, shared.expand(ids.shape[0], num_shared).to(ids.dtype)), dim=1)  # [T, top_k + S]
        num_experts += num_shared
    flat = ids.reshape(-1).to(torch.int64)  # [P]
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    device = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E] pairs per expert
    padded = (counts + block_m - 1) // block_m * block_m  # [E] rows each expert's group takes
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded  # [E]
    group_start = torch.cumsum(counts, 0) - counts  # [E] where each expert's pairs start when packed
    order = torch.argsort(flat, stable=True)  # [P] pair ids grouped by expert
    sorted_experts = flat[order]  # [P]
    rank = torch.arange(num_pairs, device=device) - group_start[sorted_experts]  # [P] place inside its group
    slots = padded_start[sorted_experts] + rank  # [P]
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device).scatter_(
        0, slots, order.to(torch.int32))  # [blocks * block_m]
    block_starts = torch.arange(blocks, device=device) * block_m  # [blocks]
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)  # [blocks]
    return ExpertAlignment(sorted_pairs, block_expert, block_m, num_pairs)
