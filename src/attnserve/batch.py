"""ForwardMode and ForwardBatch: one model step as every layer sees it.

The engine's runner builds it, models and ops read it, attention backends plan from it; none of them owns it,
so it lives here, below all of them. It says which requests run, how many tokens each and where their K/V
lives; which backend serves the step is not the step's business (whoever runs the model names it for the call:
`attention.layer.attention_backend`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from attnserve.kvcache.pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill / chunked prefill: several new tokens per request, maybe a cached prefix
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # extend and decode requests in one step (decode ones have extend_len 1)
    TARGET_VERIFY = "target_verify"  # speculative verify: draft tokens, usually with a custom mask
    IDLE = "idle"  # no tokens this step (keeps collective ops aligned across ranks)

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """What one model step computes: which requests, how many tokens each, where their KV lives.

    Lengths are per request; token tensors are the concatenation of every
    request's new tokens in batch order.
    """

    mode: ForwardMode
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int32, KV length after this step (prefix + extend)
    extend_lens: torch.Tensor  # [B] int32, tokens computed this step (1 in decode)
    positions: torch.Tensor  # [T] int64, position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, slot each new token's K/V is written to
    req_to_token: torch.Tensor  # [max_reqs, max_context] int32, the request -> slot table
    pool: KVPool
    # host copies, so plan() needs no device sync
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # speculative verify / tree attention: per request a bool [extend_len, seq_len] mask, flattened and
    # concatenated in batch order (True = may attend); replaces the causal rule when set
    custom_mask: torch.Tensor | None = None
    spec_topk: int = 0

    def __post_init__(self):
        if not self.seq_lens_cpu:
            self.seq_lens_cpu = [int(x) for x in self.seq_lens.tolist()]
        if not self.extend_lens_cpu:
            self.extend_lens_cpu = [int(x) for x in self.extend_lens.tolist()]
        if len(self.seq_lens_cpu) != len(self.extend_lens_cpu):
            raise ValueError("seq_lens and extend_lens must have one entry per request")
        if any(e > s for e, s in zip(self.extend_lens_cpu, self.seq_lens_cpu)):
            raise ValueError(f"extend_lens {self.extend_lens_cpu} exceed seq_lens {self.seq_lens_cpu}")
        if sum(self.extend_lens_cpu) != self.out_cache_loc.numel():
            raise ValueError(
                f"out_cache_loc has {self.out_cache_loc.numel()} slots, extend_lens sum to {sum(self.extend_lens_cpu)}"
            )
        if self.out_cache_loc.device.type == "cpu":
            # once per step, not per layer; on a GPU the check would stall the host every step, so
            # there the slots are trusted to come from the allocator (the runner builds them on the host)
            self.pool.check_slots(self.out_cache_loc)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]

    @property
    def prefix_lens(self) -> torch.Tensor:
        return self.seq_lens - self.extend_lens

    @classmethod
    def from_lengths(
        cls,
        mode: ForwardMode,
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        req_to_token: torch.Tensor,
        pool: KVPool,
        **kwargs,
    ) -> ForwardBatch:
        """Build a batch whose slots are already written in req_to_token (tests, kernel races, the runner)."""
        device = req_to_token.device
        seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
        rows = torch.tensor(req_pool_indices, dtype=torch.int64, device=device)
        positions = torch.cat(
            [torch.arange(p, p + e, dtype=torch.int64, device=device) for p, e in zip(prefix_lens, extend_lens)]
        ) if extend_lens else torch.zeros(0, dtype=torch.int64, device=device)
        out_cache_loc = torch.cat(
            [req_to_token[r, p : p + e].long() for r, p, e in zip(req_pool_indices, prefix_lens, extend_lens)]
        ) if extend_lens else torch.zeros(0, dtype=torch.int64, device=device)
        return cls(
            mode=mode,
            req_pool_indices=rows,
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
            extend_lens=torch.tensor(extend_lens, dtype=torch.int32, device=device),
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_to_token=req_to_token,
            pool=pool,
            seq_lens_cpu=seq,
            extend_lens_cpu=list(extend_lens),
            **kwargs,
        )
