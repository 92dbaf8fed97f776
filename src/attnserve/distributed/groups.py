"""Process groups for one tensor-parallel world: NCCL on CUDA, gloo on the CPU, over torch.distributed.

Every rank calls `init_groups` with the same address and world size; it returns once all
have joined and installs the ParallelState the parallel layers read. Collectives wait
as long as the scheduler may stay idle (a server with no requests sends no steps), so
their timeout is long: a dead peer is noticed by the process watchdog (`launch`), not
by a collective timing out.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from attnserve.distributed.state import ParallelState, set_parallel_state

IDLE_TIMEOUT = datetime.timedelta(days=7)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_groups(rank: int, world_size: int, init_addr: str, device: torch.device,
                join_timeout: datetime.timedelta = IDLE_TIMEOUT) -> ParallelState:
    """Join the world at tcp://`init_addr` as `rank` of `world_size` and install the groups."""
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", world_size=world_size, rank=rank,
                            timeout=join_timeout)
    world = dist.group.WORLD
    if backend == "nccl":  # NCCL makes its communicator at the first collective: do it now, not inside a graph capture
        dist.all_reduce(torch.zeros(1, device=device), group=world)
        torch.cuda.synchronize(device)
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    state = ParallelState(rank=rank, size=world_size, device_group=world, cpu_group=cpu_group)
    set_parallel_state(state)
    return state


def destroy_groups() -> None:
    """Leave the world (idempotent) and go back to "rank 0 of 1"."""
    set_parallel_state(ParallelState())
    if dist.is_initialized():
        dist.destroy_process_group()
