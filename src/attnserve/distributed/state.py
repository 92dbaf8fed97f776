"""Which tensor-parallel rank this process is, and the collectives the parallel layers call.

One process per rank; `set_parallel_state` is called once per process after
`torch.distributed` is initialised (`distributed.groups.init_groups`). Without a
world (tp 1, the default) every rank query answers "rank 0 of 1" and every
collective is the identity, so a model built without tensor parallelism runs the
same code with no communication at all. A world of one rank (tp 1 with an init
address) runs every collective and broadcast for real: the tensor-parallel path's
own cost, measurable on one GPU.

Two groups, as SGLang keeps them: `device_group` (NCCL on CUDA, gloo on the CPU)
carries activations; `cpu_group` (always gloo) carries the pickled step each
step the scheduler broadcasts, so host objects never travel through NCCL.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    size: int = 1
    device_group: object | None = None  # torch.distributed ProcessGroup; None at tp 1
    cpu_group: object | None = None

    @property
    def active(self) -> bool:
        """A torch.distributed world exists (a world of one rank too: tp 1 through the tensor-parallel path)."""
        return self.device_group is not None


_STATE = ParallelState()


def parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


@contextlib.contextmanager
def as_rank(rank: int, size: int):
    """Build modules as rank `rank` of `size` would (shapes and weight slices only; no groups, no collectives).

    For sizing and tests: a model built inside holds exactly the slices that rank loads."""
    previous = _STATE
    set_parallel_state(ParallelState(rank, size))
    try:
        yield
    finally:
        set_parallel_state(previous)


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (the row-parallel layers' partial sums)."""
    if _STATE.device_group is None:
        return x
    dist.all_reduce(x, group=_STATE.device_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., size * n], rank r's columns at r * n (vocab-parallel logits)."""
    if _STATE.device_group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.device_group)
    return torch.cat(parts, dim=-1)


def broadcast_object(obj=None):
    """Rank 0's `obj` on every rank (through the CPU group); what a worker waits on between steps."""
    if _STATE.cpu_group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_STATE.cpu_group)
    return box[0]


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into `x` on every rank (device group; no host sync)."""
    if _STATE.device_group is None:
        return x
    dist.broadcast(x, src=0, group=_STATE.device_group)
    return x


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's `value` (each rank sizes its KV pool from its own free memory; all must agree)."""
    if _STATE.cpu_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.cpu_group)
    return int(t.item())
