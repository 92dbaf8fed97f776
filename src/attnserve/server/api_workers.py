"""`serve --api-workers N`: N HTTP processes over one engine process, as vLLM's --api-server-count runs them.

One HTTP process is enough while JSON, SSE and detokenization fit one core next
to the engine; past that, more of them share the work. This process becomes
the server's supervisor: it owns the engine process (EngineProcess.start), binds
the port and spawns N API workers on that one listening socket (the kernel
hands each new connection to one of them). Each worker tokenizes, serves HTTP
and detokenizes with its own channel to the engine (EngineClient.attach) and
its own pipe to the supervisor. The supervisor watches every process:

- an API worker that dies: the engine is told, aborts that worker's requests
  (their KV pages go back), and a new worker takes its place (unless workers
  keep dying: RESPAWN_LIMIT deaths within RESPAWN_WINDOW_S stop the server);
- the engine process that dies: every worker hears why, turns /health to 503
  and ends its open requests with that reason (as the one-process server does);
- SIGINT/SIGTERM: the workers shut down gracefully (open streams finish, up to
  --graceful-shutdown-timeout), then the engine stops, and the exit status is 0;
- the supervisor itself killed: each worker sees its pipe close and shuts down,
  and the engine process sees its owner gone and exits.

HTTP-side metrics (latency histograms, token counters) live in each worker;
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, a private
directory per server) adds them up, so any worker's /metrics covers them all.
--max-queued-requests is split among the workers (each admits its share).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import uvicorn

from attnserve.server.engine_client import EngineClient
from attnserve.server.engine_owner import EngineProcess, exit_description
from attnserve.server.uvicorn_server import UvicornServer, announce_serving

log = logging.getLogger("attnserve.server")

POLL_S = 0.2  # how often the supervisor looks at its signals between process events
STOP_MARGIN_S = 15.0  # past the graceful-shutdown timeout: how long a stopping worker may take before a kill
RESPAWN_LIMIT, RESPAWN_WINDOW_S = 5, 60.0  # this many worker deaths within the window stop the server


@dataclass
class WorkerSpec:
    """What every API worker is built from (pickled into each spawned worker)."""

    channel_dir: str
    facts: dict  # the engine's ready facts: tokenizer, context, info
    settings: object  # ServerSettings
    uvicorn_options: dict  # uvicorn.Config keywords other than the app, host and port


def _worker_main(spec: WorkerSpec, identity: bytes, sock, conn) -> None:
    """An API worker: the app over an attached engine client, served by uvicorn on the shared socket."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from attnserve.server.app import ServerState, create_app

    def started(host, port) -> None:
        try:
            conn.send(("ready", os.getpid()))
        except OSError:  # the supervisor is gone: the engine client's watch shuts this worker down
            pass

    engine = EngineClient.attach(spec.channel_dir, spec.facts, conn, identity)
    state = ServerState(engine, spec.settings)
    config = uvicorn.Config(create_app(state), **spec.uvicorn_options)
    server = UvicornServer(config, on_started=started)
    try:
        server.run(sockets=[sock])
    finally:
        engine.release()


@dataclass
class Worker:
    process: multiprocessing.Process
    conn: multiprocessing.connection.Connection  # the pipe to it: ("ready", pid) in, ("engine_exit", why) out
    identity: bytes  # its name on the engine's socket


class Supervisor:
    """The API workers and the engine process they share; `run` until a signal, then stop them all."""

    def __init__(self, engine: EngineProcess, spec: WorkerSpec, workers: int, host: str, port: int):
        self.engine = engine
        self.spec = spec
        self.count = workers
        self.sock = uvicorn.Config(app=None, host=host, port=port, log_level="warning").bind_socket()
        self._mp = multiprocessing.get_context("spawn")
        self.workers: dict[int, Worker] = {}
        self.engine_reason: str | None = None  # why the engine process ended, once it has
        self._signal: int | None = None
        self._started = 0  # workers spawned so far: each gets a new identity on the engine's socket
        self._deaths: list[float] = []  # when workers died (monotonic), for the respawn limit

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        for index in range(self.count):
            self._spawn(index)
        if not self._wait_ready():
            self._stop()
            return 1
        host, port = self.sock.getsockname()[:2]
        pids = ", ".join(str(w.process.pid) for w in self.workers.values())
        announce_serving(host, port, f" with {self.count} API workers (pids {pids})")
        status = None
        while self._signal is None and status is None:
            status = self._watch_once()
        if self._signal is not None:
            log.info("shutting down (signal %d): finishing open streams", self._signal)
        self._stop()
        return status or 0

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def _spawn(self, index: int) -> None:
        ours, theirs = self._mp.Pipe()
        identity = f"api-{index}-{self._started}".encode()
        self._started += 1
        process = self._mp.Process(target=_worker_main, args=(self.spec, identity, self.sock, theirs),
                                   name=f"attnserve-api-{index}", daemon=True)
        process.start()
        theirs.close()
        self.workers[index] = Worker(process, ours, identity)

    def _wait_ready(self) -> bool:
        """Every worker's ("ready", pid); False if one ends first (its error is on stderr)."""
        waiting = dict(self.workers)
        while waiting and self._signal is None:
            by_conn = {w.conn: index for index, w in waiting.items()}
            for ready in multiprocessing.connection.wait([*by_conn, *(w.process.sentinel for w in waiting.values())],
                                                         POLL_S):
                index = by_conn.get(ready)  # None: a worker's sentinel, so it has ended
                if index is not None:
                    try:
                        ready.recv()
                        del waiting[index]
                        continue
                    except EOFError:
                        pass
                log.error("an API worker exited while starting: the server stops")
                return False
        return not waiting

    def _watch_once(self) -> int | None:
        """Wait up to POLL_S for a process to end or a new worker to be ready, and handle it; an exit status
        when the server must stop."""
        by_sentinel = {w.process.sentinel: index for index, w in self.workers.items()}
        by_conn = {w.conn: index for index, w in self.workers.items()}
        watched = [*by_sentinel, *by_conn]
        if self.engine_reason is None:
            watched.append(self.engine.process.sentinel)
        for ready in multiprocessing.connection.wait(watched, POLL_S):
            if self._signal is not None:
                return None  # stopping: a worker ending now is part of it
            if ready in by_conn:
                try:
                    _, pid = ready.recv()
                    log.info("API worker %d (pid %d) is ready", by_conn[ready], pid)
                except (EOFError, OSError):
                    pass  # it died: its sentinel says so
            elif ready in by_sentinel:
                if not self._replace(by_sentinel[ready]):
                    return 1
            else:
                self.engine.process.join(5)
                self.engine_reason = self.engine.exit_reason()
                log.error("%s; every API worker now refuses new requests", self.engine_reason)
                for w in self.workers.values():
                    self._tell(w.conn, self.engine_reason)
        return None

    def _replace(self, index: int) -> bool:
        """A worker died: the engine ends its requests, and a new worker serves in its place; False when
        workers keep dying (the server stops)."""
        dead = self.workers.pop(index)
        dead.process.join(5)
        dead.conn.close()
        if self.engine_reason is None:
            self.engine.client_gone(dead.identity)
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESPAWN_WINDOW_S] + [now]
        what = exit_description(dead.process.exitcode, f"API worker {index} (pid {dead.process.pid})")
        if len(self._deaths) >= RESPAWN_LIMIT:
            log.error("%s: %d API workers died within %.0f s, so the server stops", what, len(self._deaths),
                      RESPAWN_WINDOW_S)
            return False
        log.error("%s; its requests are aborted and a new worker starts", what)
        self._spawn(index)
        if self.engine_reason is not None:
            self._tell(self.workers[index].conn, self.engine_reason)
        return True

    @staticmethod
    def _tell(conn, reason: str) -> None:
        try:
            conn.send(("engine_exit", reason))
        except OSError:  # that worker is gone too; its sentinel says so next
            pass

    def _stop(self) -> None:
        """Workers first (each finishes its streams), then the engine."""
        for w in self.workers.values():
            if w.process.is_alive():
                os.kill(w.process.pid, signal.SIGTERM)
        timeout = self.spec.uvicorn_options.get("timeout_graceful_shutdown") or 0
        deadline = time.monotonic() + timeout + STOP_MARGIN_S
        for w in self.workers.values():
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                log.warning("API worker pid %d did not stop: killing it", w.process.pid)
                w.process.kill()
                w.process.join()
            w.conn.close()
        self.sock.close()
        self.engine.stop()


def serve_with_workers(engine: EngineProcess, settings, uvicorn_options: dict, workers: int, host: str,
                       port: int) -> int:
    """Run the supervisor over `engine` until a signal; the exit status."""
    metrics_dir = tempfile.mkdtemp(prefix="attnserve-metrics-")
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each worker as it imports prometheus_client
    if settings.max_queued_requests is not None:  # each worker admits its share
        settings = dataclasses.replace(settings, max_queued_requests=math.ceil(settings.max_queued_requests / workers))
    try:
        spec = WorkerSpec(engine.channel_dir, engine.facts, settings, uvicorn_options)
        return Supervisor(engine, spec, workers, host, port).run()
    finally:
        if before is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
        shutil.rmtree(metrics_dir, ignore_errors=True)
