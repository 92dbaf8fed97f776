"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of vocabulary rows.

The vocabulary is padded up to a multiple of the tp size (padding rows are zero and never chosen:
the gathered logits are cut back to the real vocabulary). Embedding: each rank looks up the ids in
its block, zeros for the others, and an all-reduce sums the one non-zero row per token. LM head:
each rank computes its block of logits and an all-gather joins them (only the rows that are
sampled reach the head, so this moves [sampled tokens, vocab] per step, not [tokens, vocab]).
A tied LM head shares the embedding's block, so tying still works rank by rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.distributed.linear import copy_checked
from attnserve.distributed.shard import take
from attnserve.distributed.state import all_gather_last_dim, all_reduce, parallel_state, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Token embedding: ids [T] -> rows of a [vocab, hidden] table, this rank holding rows [start, start + n)."""

    reads_slices = True

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        size = tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // size)  # padded block
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.num_real_rows = max(0, min(self.rows_per_rank, vocab_size - self.vocab_start))  # the rest is padding
        self.sharded = size > 1 or parallel_state().active  # a world of one rank runs the collectives too
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False)  # [V_r, hidden]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int = 0, name: str = "") -> None:
        n = self.num_real_rows
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(loaded.shape)} has not {self.vocab_size} rows")
        if n:
            copy_checked(param.data[:n], take(loaded, 0, self.vocab_start, n), name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.rows_per_rank)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(hidden)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states [T, hidden] -> logits [T, vocab] on every rank (the embedding table's shape; tied if asked)."""

    cpu_matmul = None  # a models.cpu_weights.CPUMatmul (prepacked bf16) on a CPU model of one rank

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_matmul is not None:
            return self.cpu_matmul(hidden)
        logits = F.linear(hidden, self.weight)  # [T, V_r]
        if not self.sharded:
            return logits
        return all_gather_last_dim(logits)[..., : self.vocab_size]  # [T, V]
