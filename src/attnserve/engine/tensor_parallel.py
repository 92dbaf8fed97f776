"""Running the engine over several tensor-parallel ranks.

Rank 0 is the engine's own process: it schedules, and its runner broadcasts each step's host
inputs (`runner.StepInputs`) to the other ranks before running it; sampling happens on rank 0
alone, from logits every rank holds in full, and the sampled ids are broadcast on the device
into every rank's `last_tokens` (what the next decode step reads, before the host has seen them). Every other rank runs `serve_rank`: the same start-up
(its slice of the weights, its heads' KV pool, its own CUDA graphs) and then the steps it is sent,
until rank 0 sends None. On nodes other than 0 the process only hosts workers (`run_node`).

Everything that can be checked before a weight is read is checked first: the tp size against the
model's heads and channels, the GPUs, the init address's port.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import replace

import numpy as np
import torch

from attnserve.distributed.groups import destroy_groups, init_groups
from attnserve.distributed.launch import (
    Topology,
    Workers,
    check_devices,
    rank_device,
    resolve_init_addr,
)
from attnserve.distributed.shard import check_model_splits
from attnserve.distributed.state import broadcast_object, parallel_state
from attnserve.engine.config import EngineConfig
from attnserve.engine.runner import ModelRunner
from attnserve.engine.startup import build_parts, resolve_device
from attnserve.models.loader import read_config
from attnserve.transfers import to_device

log = logging.getLogger("attnserve.engine")


def topology_of(config: EngineConfig) -> Topology:
    return Topology(config.tp_size, config.nnodes, config.node_rank, config.dist_init_addr)


def check_before_loading(config: EngineConfig, loaded=None):
    """Refuse a tensor-parallel start that cannot work, reading no weights; returns (topology, device)."""
    topology = topology_of(config)
    if loaded is not None:
        raise ValueError(f"--tp-size {config.tp_size}: each rank loads its own slice of the weights, so pass the "
                         "model by path (model=...), not an already loaded model")
    cfg = read_config(config.model, config.random_weights)
    try:
        check_model_splits(cfg, config.tp_size)
    except ValueError as exc:
        raise ValueError(f"--tp-size {config.tp_size} cannot split {config.model or 'the embedded model'}: {exc}") from None
    device = resolve_device(config.device)
    check_devices(device, topology)
    return topology, device


def serve_rank(config: EngineConfig) -> None:
    """A worker rank: build the same engine parts as rank 0, then run each step rank 0 broadcasts."""
    runner = ModelRunner.from_parts(build_parts(config))
    while True:
        step = broadcast_object()
        if step is None:
            return
        runner.run(step)
        if any(step.sample):  # rank 0 samples; its tokens come to every rank's last_tokens for the next decode
            rows = step.host[3 * step.num_tokens :][np.asarray(step.sample)]  # [S] request rows
            runner.record_sampled(to_device(rows, runner.device), torch.empty(len(rows), dtype=torch.int64,
                                                                              device=runner.device))


def _worker_args(config: EngineConfig):
    def args(rank, device):
        return (replace(config, device=str(device)),)
    return args


class TensorParallelWorld:
    """Rank 0's view of the world: the workers on this node and the groups; `close` ends both."""

    def __init__(self, config: EngineConfig, loaded=None):
        if config.tp_size > 1:
            topology, device = check_before_loading(config, loaded)
        else:  # a world of one rank: the model may come loaded, nothing is split
            topology, device = topology_of(config), resolve_device(config.device)
        addr = resolve_init_addr(topology)
        self.workers = Workers(topology, addr, device, serve_rank, _worker_args(config))
        self._closed = False
        try:
            init_groups(0, topology.tp_size, addr, rank_device(device, topology, 0))
        except BaseException:
            self.workers.close(timeout=0)
            raise
        atexit.register(self.close)
        log.info("tensor parallel: %d ranks over %d node(s) (%s), worker pids %s", topology.tp_size,
                 topology.nnodes, "nccl" if device.type == "cuda" else "gloo", self.workers.pids)

    def close(self) -> None:
        """Tell every rank to stop, wait for this node's workers, leave the groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.workers.expect_exits()
        try:
            if parallel_state().active:
                broadcast_object(None)
        finally:
            self.workers.close()
            destroy_groups()
            atexit.unregister(self.close)

    def abort(self) -> None:
        """Start-up failed on rank 0: the other ranks may be waiting in a collective, so end them now."""
        self._closed = True
        self.workers.close(timeout=0)
        destroy_groups()
        atexit.unregister(self.close)


def start_world(config: EngineConfig, loaded=None) -> TensorParallelWorld | None:
    """The tensor-parallel world for this engine, or None at tp 1 (nothing is spawned). tp 1 with an init
    address forms a world of one rank: the tensor-parallel code path, collectives included, on one device."""
    if config.tp_size == 1 and config.dist_init_addr is None:
        return None
    if config.node_rank != 0:
        raise ValueError(f"--node-rank {config.node_rank}: only node 0 runs the engine; run_node hosts the others")
    return TensorParallelWorld(config, loaded)


def run_node(config: EngineConfig) -> int:
    """A node other than 0: spawn this node's ranks and wait until rank 0 ends the world (or a rank fails)."""
    topology, device = check_before_loading(config)
    addr = resolve_init_addr(topology)
    workers = Workers(topology, addr, device, serve_rank, _worker_args(config), skip_rank0=False)
    log.info("node %d of %d: ranks %s (pids %s) joining %s", topology.node_rank, topology.nnodes,
             list(topology.local_ranks), workers.pids, addr)
    return workers.wait()
