"""The engine process as its owner holds it: spawned, built, told to stop, reaped, explained.

The owner is the HTTP process of a one-process server, or the supervisor of
--api-workers (api_workers.py). It keeps one end of a pipe open for as long as
it lives (the engine process exits at its EOF, see engine_process.py), the
channel's private directory, and the facts the engine sent when it was built.
Requests never pass through here: each HTTP process streams them over its own
EngineClient (engine_client.py). The owner's own socket carries only control
commands (shutdown, a dead worker's notice), from one thread.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import zmq

from attnserve.engine.config import EngineConfig
from attnserve.server.engine_process import FAILURE_FILE, engine_address, run_engine_process
from attnserve.server.wire import ClientGone, Shutdown, ToEngine, to_wire

log = logging.getLogger("attnserve.server")

STOP_TIMEOUT_S = 30.0  # how long a stopping engine process may take to finish its step and exit


def exit_description(code: int | None, what: str = "the engine process") -> str:
    if code is not None and code < 0:
        return f"{what} was killed by {signal.Signals(-code).name}"
    return f"{what} exited with code {code}"


def dealer(channel_dir: str, context: zmq.Context, identity: bytes) -> zmq.Socket:
    """A DEALER socket to the engine's ROUTER; its identity names the sender in the engine."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(engine_address(channel_dir))
    return sock


class EngineProcess:
    """A spawned, built engine process (`start`), until `release`."""

    def __init__(self, process: multiprocessing.Process, conn, channel_dir: str, facts: dict):
        self.process = process
        self.channel_dir = channel_dir
        self.facts = facts  # what the engine sent once built: pid, tokenizer, context, info, state
        self._conn = conn  # kept open: its EOF tells the engine process its owner is gone
        self._context = zmq.Context()
        self._control = dealer(channel_dir, self._context, f"owner-{os.getpid()}".encode())
        self.stopping = False

    @classmethod
    def start(cls, config: EngineConfig, setup: Callable | None = None) -> EngineProcess:
        """Spawn the engine process and wait until its engine is built; raises its start-up error.
        `setup(engine)`: a picklable function the engine process runs once the engine is built."""
        channel_dir = tempfile.mkdtemp(prefix="attnserve-ipc-")  # mode 0700: only this user reaches the socket
        mp = multiprocessing.get_context("spawn")
        conn, child_conn = mp.Pipe()
        process = mp.Process(target=run_engine_process, args=(config, channel_dir, child_conn, setup),
                             name="attnserve-engine")
        try:
            process.start()
            child_conn.close()
            multiprocessing.connection.wait([conn, process.sentinel])
            try:
                kind, payload = conn.recv()
            except EOFError:
                process.join(10)
                raise RuntimeError(f"{exit_description(process.exitcode)} during start-up") from None
            if kind == "failed":
                process.join(10)
                raise payload
        except BaseException:
            if process.is_alive():
                process.kill()
            if process.pid is not None:
                process.join()
            conn.close()
            shutil.rmtree(channel_dir, ignore_errors=True)
            raise
        return cls(process, conn, channel_dir, payload)

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_reason(self) -> str:
        """Why the (ended, reaped) engine process ended: its last words if it left any, else its exit code."""
        try:
            return Path(self.channel_dir, FAILURE_FILE).read_text()
        except OSError:
            return exit_description(self.process.exitcode)

    def send(self, cmd: ToEngine) -> None:
        """A control command to the engine (dropped if no engine is connected any more)."""
        try:
            self._control.send(to_wire(cmd), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def client_gone(self, identity: bytes) -> None:
        """Tell the engine that a client process (an API worker) has died: its requests end."""
        self.send(ClientGone(identity))

    def request_stop(self) -> None:
        """Ask the engine to stop: its step in flight completes, every open request ends aborted, it exits."""
        if not self.stopping:
            self.stopping = True
            self.send(Shutdown())

    def stop(self) -> None:
        """Stop the engine and wait for it (killed if it does not exit within STOP_TIMEOUT_S); for a thread
        that nothing else reaps the process from (the supervisor's)."""
        if self.process.is_alive():
            self.request_stop()
            self.process.join(STOP_TIMEOUT_S)
            if self.process.is_alive():
                log.warning("the engine process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)

    def release(self) -> None:
        """Kill the engine process if it still runs and free the pipe, socket and directory (idempotent)."""
        self.stopping = True
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        if self._context.closed:
            return
        self._conn.close()
        self._control.close()
        self._context.term()
        shutil.rmtree(self.channel_dir, ignore_errors=True)
