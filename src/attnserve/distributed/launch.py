"""Starting and watching the worker processes of a tensor-parallel world.

Rank 0 is the process that schedules (the engine's own process on node 0); every other rank is a
worker process spawned here, one per local rank. A watchdog thread waits on the workers' exit
sentinels: a worker that exits while the world is running (killed, out of memory, or an exception
it logged with its rank) stops everything at once, naming the rank, since the ranks' collectives
could otherwise wait on it for ever. Workers watch their parent in turn and exit when it is gone,
so no rank outlives the world.

Start-up is refused before anything is spawned or loaded when the world cannot work: a tp size that
does not split the model, fewer GPUs than local ranks, or an init address whose port is taken.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnserve.distributed.groups import destroy_groups, init_groups

log = logging.getLogger("attnserve.distributed")


@dataclass(frozen=True)
class Topology:
    """tp_size ranks over nnodes machines (SGLang's --nnodes / --node-rank / --dist-init-addr)."""

    tp_size: int
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of node 0; None on one node: a free local port

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                             "(each machine runs the same number of ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
        if self.dist_init_addr is not None:
            split_addr(self.dist_init_addr)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)

    def local_index(self, rank: int) -> int:
        return rank - self.node_rank * self.ranks_per_node


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT with a port in 1..65535, got {addr!r}")
    return host, int(port)


def check_port_free(port: int) -> None:
    """Refuse a port something already listens on (rank 0 binds it to meet the other ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as exc:
            raise ValueError(f"--dist-init-addr port {port} is in use ({exc.strerror}); pick a free port") from exc


def free_local_addr() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def resolve_init_addr(topology: Topology) -> str:
    """The address every rank meets at; on node 0 its port is checked free."""
    if topology.dist_init_addr is None:
        return free_local_addr()
    _, port = split_addr(topology.dist_init_addr)
    if topology.node_rank == 0:
        check_port_free(port)
    return topology.dist_init_addr


def check_devices(device: torch.device, topology: Topology) -> None:
    """One GPU per local rank."""
    if device.type != "cuda":
        return
    have = torch.cuda.device_count()
    need = topology.ranks_per_node
    if have < need:
        raise ValueError(f"--tp-size {topology.tp_size} over {topology.nnodes} node(s) needs {need} GPUs on this "
                         f"machine, found {have}; lower --tp-size or add --nnodes")


def rank_device(device: torch.device, topology: Topology, rank: int) -> torch.device:
    return torch.device("cuda", topology.local_index(rank)) if device.type == "cuda" else device


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the parent goes (PR_SET_PDEATHSIG where Linux offers it, and a poll everywhere)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def poll():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def _worker_main(rank: int, world: int, init_addr: str, device: str, parent_pid: int, cpu_threads: int,
                 target: Callable, args: tuple) -> None:
    """A spawned rank: join the world, run `target(*args)` until it returns, exit 1 (logged) if it raises."""
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if torch.device(device).type == "cpu":
        torch.set_num_threads(cpu_threads)
    try:
        init_groups(rank, world, init_addr, torch.device(device))
        target(*args)
    except BaseException:  # any failure ends this rank; the parent's watchdog reports it
        logging.getLogger("attnserve.distributed").exception("tensor-parallel rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)
    destroy_groups()
    sys.stderr.flush()
    os._exit(0)


# called with the message before a dead rank ends this process (a server's engine process tells its HTTP side)
failure_reporters: list[Callable[[str], None]] = []


def _exit_process(message: str) -> None:
    """The default reaction to a dead rank: the world cannot go on, so neither can this process."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    for report in failure_reporters:
        try:
            report(message)
        except Exception:  # noqa: BLE001 - the process ends either way
            pass
    os._exit(1)


class Workers:
    """The spawned ranks of this node and the watchdog over them."""

    def __init__(self, topology: Topology, init_addr: str, device: torch.device, target: Callable,
                 args_for_rank: Callable[[int, torch.device], tuple], skip_rank0: bool = True,
                 on_failure: Callable[[str], None] = _exit_process):
        self.topology = topology
        self.on_failure = on_failure
        self._closing = threading.Event()
        ctx = multiprocessing.get_context("spawn")
        ranks = [r for r in topology.local_ranks if not (skip_rank0 and r == 0)]
        threads = max(1, (os.cpu_count() or 1) // max(1, topology.ranks_per_node))
        self.procs: dict[int, multiprocessing.Process] = {}
        for rank in ranks:
            dev = rank_device(device, topology, rank)
            p = ctx.Process(target=_worker_main, name=f"attnserve-tp-rank-{rank}", daemon=True,
                            args=(rank, topology.tp_size, init_addr, str(dev), os.getpid(), threads, target,
                                  args_for_rank(rank, dev)))
            p.start()
            self.procs[rank] = p
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.procs.items()}

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: rank for rank, p in self.procs.items()}
        while by_sentinel:
            ready = multiprocessing.connection.wait(list(by_sentinel), timeout=1.0)
            if self._closing.is_set():
                return
            for sentinel in ready:
                rank = by_sentinel.pop(sentinel)
                proc = self.procs[rank]
                proc.join(timeout=1.0)
                code = proc.exitcode
                if code == 0:
                    continue  # a rank leaves with 0 only once rank 0 has told the world to stop
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
                message = (f"error: tensor-parallel rank {rank} (pid {proc.pid}) {how} while the world was running; "
                           "stopping every rank")
                log.error(message)
                self._kill_all()
                self.on_failure(message)
                return

    def _kill_all(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join(timeout=5.0)

    def expect_exits(self) -> None:
        """The world is being ended on purpose: workers leaving from now on are not failures."""
        self._closing.set()

    def close(self, timeout: float = 10.0) -> None:
        """Wait for the workers to leave (after they were told to stop), killing those that do not."""
        self.expect_exits()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill_all()

    def wait(self) -> int:
        """Block until every worker has exited (a node other than 0 has nothing else to do); 0 if all exited 0.

        A worker that fails meanwhile is handled by the watchdog as on node 0."""
        for p in self.procs.values():
            p.join()
        return max((abs(p.exitcode or 0) for p in self.procs.values()), default=0)
