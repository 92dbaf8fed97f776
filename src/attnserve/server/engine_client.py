"""An HTTP process's end of the engine process: stream requests through it, notice its end.

As in SGLang, the process that serves HTTP tokenizes prompts and detokenizes
outputs, and the scheduler and model run in a process of their own
(engine_process.py), so JSON, SSE and text never take the GIL from a step.
Requests go over as token ids with their SamplingParams; token deltas come back
and a RequestStream per completion makes their text here.

`EngineClient.start` spawns the engine process and blocks until it is built
(its start-up error, if any, is raised here, before a port is bound); that
client owns the process. With --api-workers, each worker process makes its own
client with `EngineClient.attach` over the same engine, which the server's
supervisor owns (server/api_workers.py). Inside the server's event loop,
`connect` starts reading the socket and watching the engine's end (the process
itself for the owner, the supervisor's word for a worker): when it ends, every
open request ends with an error that names the cause and `alive` turns False.
`aclose` stops the engine cleanly (the owner) or only the channel (a worker);
`release` kills what is left (it runs whatever happened before).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio

from attnserve.engine.config import EngineConfig
from attnserve.engine.loop import Item, RequestHandle
from attnserve.engine.outputs import RequestStream
from attnserve.engine.sampling_params import SamplingParams
from attnserve.models.tokenizer import encode
from attnserve.server.engine_process import (FAILURE_FILE, client_identity, engine_address, from_wire,
                                              run_engine_process, to_wire)

log = logging.getLogger("attnserve.server")

STOP_TIMEOUT_S = 30.0  # how long a stopping engine process may take to finish its step and exit
QUERY_TIMEOUT_S = 30.0  # a state query unanswered this long returns the last state read


class RemoteRequest(RequestHandle):
    """A request submitted to the engine process; `accepted` resolves when the engine queued it, or raises
    what the engine refused it with (ValueError for bad input)."""

    def __init__(self, client: EngineClient, rid: int, stream: RequestStream, sink: Callable[[Item], None]):
        super().__init__(client, rid, stream, sink)
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        # a refusal that nobody awaits (its group failed earlier) is not an error worth a warning
        self.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())


def exit_description(code: int | None, what: str = "the engine process") -> str:
    if code is not None and code < 0:
        return f"{what} was killed by {signal.Signals(-code).name}"
    return f"{what} exited with code {code}"


def _channel(channel_dir: str, context: zmq.Context, identity: bytes) -> zmq.Socket:
    """This client's DEALER socket to the engine's ROUTER; its identity names it in the engine."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(engine_address(channel_dir))
    return sock


class EngineClient:
    """One channel to the engine process; used from the HTTP server's event loop once `connect`ed. The client
    made by `start` owns the process (`process`); one made by `attach` watches `engine_end` instead, a pipe
    on which the process's owner sends ("engine_exit", why) and whose EOF means the owner is gone."""

    def __init__(self, channel_dir: str, facts: dict, process=None, conn=None, engine_end=None,
                 identity: bytes | None = None):
        self.process = process
        self.pid: int = facts["pid"]
        self.tokenizer = facts["tokenizer"]
        self.chat_template: str | None = facts["chat_template"]
        self.max_context_len: int = facts["max_context_len"]
        self.pool_tokens: int = facts["pool_tokens"]
        self.info: dict = facts["info"]
        self.facts = facts
        self.last_state: dict = facts["state"]  # answers state queries once the engine is gone
        self.error: str | None = None
        self.channel_dir = channel_dir
        self._conn = conn  # the owner keeps it open: its EOF tells the engine process this one is gone
        self._engine_end = engine_end
        self._context = zmq.Context()
        self._sock = _channel(channel_dir, self._context, identity or client_identity(os.getpid()))
        self._handles: dict[int, RemoteRequest] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._rids, self._qids = itertools.count(), itertools.count()
        self._receiver: asyncio.Task | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._ended = False  # the engine process is known to have ended
        self._exited: asyncio.Event | None = None  # the owner's, on the event loop: set once the process is reaped
        self.exitcode: int | None = None  # the owner's: set once the event loop has reaped the process

    # ---- start and stop ---------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig, setup: Callable | None = None) -> EngineClient:
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
        return cls(channel_dir, payload, process=process, conn=conn)

    @classmethod
    def attach(cls, channel_dir: str, facts: dict, engine_end, identity: bytes) -> EngineClient:
        """A client of an engine process that another process owns (an API worker's), named `identity` on the
        engine's socket (unique per worker the owner starts)."""
        return cls(channel_dir, facts, engine_end=engine_end, identity=identity)

    @property
    def owner(self) -> bool:
        return self.process is not None

    def exit_reason(self) -> str:
        """Why the (ended) engine process ended: its last words if it left any, else its exit code."""
        try:
            return Path(self.channel_dir, FAILURE_FILE).read_text()
        except OSError:
            return exit_description(self.process.exitcode)

    async def connect(self) -> None:
        """Start reading the engine's output and watching its end, on the running event loop."""
        self._aio = asyncio.get_running_loop()
        self._receiver = asyncio.create_task(self._receive(zmq.asyncio.Socket.from_socket(self._sock)))
        if self.owner:
            self._exited = asyncio.Event()
            self._aio.add_reader(self.process.sentinel, self._on_exit)
            if not self.process.is_alive():
                self._on_exit()
        else:
            self._aio.add_reader(self._engine_end.fileno(), self._on_owner_message)

    def stop(self) -> None:
        """The owner's clean stop outside an event loop (the supervisor's): the engine's step in flight
        completes, every open request ends aborted, and the process exits (killed if it does not within
        STOP_TIMEOUT_S)."""
        if self.process.is_alive() and not self._stopping:
            self._stopping = True
            self._send(("shutdown",))
            self.process.join(STOP_TIMEOUT_S)
            if self.process.is_alive():
                log.warning("the engine process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
        self._stopping = True

    async def aclose(self) -> None:
        """Stop the engine process (the owner) or leave it (a worker); every request still open here ends.
        The socket and the process are touched on the event loop's thread only (`_on_exit` reaps)."""
        if self.owner and not self._stopping and not self._exited.is_set():
            self._stopping = True
            self._send(("shutdown",))
            try:
                await asyncio.wait_for(self._exited.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("the engine process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
        self._stopping = True
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self._drain()
        self._end_open("the engine process stopped")
        self.release()

    def release(self) -> None:
        """Kill the engine process if this client owns it and it still runs, and free the channel
        (idempotent)."""
        self._stopping = True
        if self.owner:
            if self.process.is_alive():
                self.process.kill()
            self.process.join()
        if self._context.closed:
            return
        if self._aio is not None and not self._aio.is_closed():
            self._aio.remove_reader(self.process.sentinel if self.owner else self._engine_end.fileno())
        if self._conn is not None:
            self._conn.close()
        self._sock.close()
        self._context.term()
        if self.owner:
            shutil.rmtree(self.channel_dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping and not self._ended and (
            not self.owner or self.process.is_alive())

    # ---- requests (on the event loop) -------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
        return encode(self.tokenizer, prompt)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Item], None],
               speculative: bool = True) -> RemoteRequest:
        """Send a request to the engine; await the handle's `accepted` before relying on it."""
        if not self.alive:
            raise RuntimeError(f"the engine is not running: {self.error or 'it has stopped'}")
        rid = next(self._rids)
        stream = RequestStream(self.tokenizer, params, None, prompt_ids, time.perf_counter())
        handle = RemoteRequest(self, rid, stream, sink)
        self._handles[rid] = handle
        self._send(("add", rid, prompt_ids, params, speculative))
        return handle

    def abort(self, rid: int) -> None:
        self._send(("abort", rid))

    def client_gone(self, identity: bytes) -> None:
        """The owner tells the engine that a client process (an API worker) has died: its requests end."""
        self._send(("client_gone", identity))

    def stop_request(self, rid: int, stop: str) -> None:
        self._send(("stop", rid, stop))

    async def state(self) -> dict:
        """The engine's requests, KV pages and counters now (the last ones read once it is gone)."""
        if not self.alive:
            return self.last_state
        qid = next(self._qids)
        future = self._queries[qid] = asyncio.get_running_loop().create_future()
        self._send(("state", qid))
        try:
            return await asyncio.wait_for(future, QUERY_TIMEOUT_S)
        except (RuntimeError, TimeoutError):
            return self.last_state
        finally:
            self._queries.pop(qid, None)

    def _send(self, cmd: tuple) -> None:
        try:
            self._sock.send(to_wire(cmd), zmq.NOBLOCK)
        except zmq.Again:  # no engine connected: it is gone, and its end is being handled
            pass

    # ---- what comes back --------------------------------------------------------------------
    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._dispatch(from_wire(await sock.recv()))

    def _drain(self) -> None:
        """Read what is left on the socket without waiting (the engine process has ended)."""
        while True:
            try:
                self._dispatch(from_wire(self._sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return

    def _dispatch(self, events: list[tuple]) -> None:
        for event in events:
            kind = event[0]
            if kind == "item":
                handle = self._handles.get(event[1])
                if handle is None:
                    continue
                item = event[2]
                if item is None:
                    del self._handles[event[1]]
                elif not handle.accepted.done():
                    if isinstance(item, BaseException):  # refused
                        handle.accepted.set_exception(item)
                        continue
                    handle.accepted.set_result(None)  # queued as the engine stopped: it ends aborted
                handle.deliver(item)
            elif kind == "accepted":
                handle = self._handles.get(event[1])
                if handle is not None and not handle.accepted.done():
                    handle.accepted.set_result(None)
            elif kind == "state":
                self.last_state = event[2]
                future = self._queries.get(event[1])
                if future is not None and not future.done():
                    future.set_result(event[2])
            elif kind == "failed":
                self.error = self.error or f"the engine failed: {event[1]}"
                log.error("%s; new requests are refused", self.error)

    def _on_exit(self) -> None:
        """The engine process ended (the owner sees it): read its last messages, then end every open request
        with the cause."""
        self._aio.remove_reader(self.process.sentinel)
        self.process.join(5)  # reaped on this thread only: a second thread's waitpid could see no exit code
        self.exitcode = self.process.exitcode
        self._exited.set()
        self.engine_ended(self.exit_reason())

    def _on_owner_message(self) -> None:
        """A worker hears from the engine's owner: the engine ended (and why), or, at EOF, the owner is gone
        and so is this server (its graceful shutdown starts, as on SIGTERM)."""
        try:
            kind, reason = self._engine_end.recv()
        except (EOFError, OSError):
            self._aio.remove_reader(self._engine_end.fileno())
            log.error("the server's supervisor is gone: shutting this API worker down")
            self.engine_ended("the server's supervisor is gone")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if kind == "engine_exit":
            self.engine_ended(reason)

    def engine_ended(self, reason: str) -> None:
        """Read the engine's last messages, then end every open request with `reason` (or the engine's own
        failure message, if it sent one first)."""
        self._ended = True
        self._drain()
        if not self._stopping and self.error is None:
            self.error = reason
            log.error("%s; new requests are refused", self.error)
        self._end_open(self.error or "the engine process stopped")

    def _end_open(self, reason: str) -> None:
        for handle in list(self._handles.values()):
            if not handle.accepted.done():
                handle.accepted.set_exception(RuntimeError(reason))
            else:
                handle.deliver(RuntimeError(reason))
            handle.deliver(None)
        self._handles.clear()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(RuntimeError(reason))
