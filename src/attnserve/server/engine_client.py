"""The HTTP process's end of the engine process: spawn it, stream requests through it, notice its end.

As in SGLang, the process that serves HTTP tokenizes prompts and detokenizes
outputs, and the scheduler and model run in a process of their own
(engine_process.py), so JSON, SSE and text never take the GIL from a step.
Requests go over as token ids with their SamplingParams; token deltas come back
and a RequestStream per completion makes their text here.

`EngineClient.start` spawns the engine process and blocks until it is built
(its start-up error, if any, is raised here, before a port is bound). Inside
the server's event loop, `connect` starts reading the output socket and
watching the process: when it dies, every open request ends with an error that
names the cause and `alive` turns False. `aclose` stops it cleanly; `release`
kills what is left (it runs whatever happened before).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
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
from attnserve.server.engine_process import from_wire, run_engine_process, to_wire

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


def exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"the engine process was killed by {signal.Signals(-code).name}"
    return f"the engine process exited with code {code}"


class EngineClient:
    """One engine process and its channel; used from the HTTP server's event loop once `connect`ed."""

    def __init__(self, process, conn, ipc_dir: str, context: zmq.Context, commands: zmq.Socket,
                 outputs: zmq.Socket, facts: dict):
        self.process = process
        self.pid: int = facts["pid"]
        self.tokenizer = facts["tokenizer"]
        self.chat_template: str | None = facts["chat_template"]
        self.max_context_len: int = facts["max_context_len"]
        self.pool_tokens: int = facts["pool_tokens"]
        self.info: dict = facts["info"]
        self.last_state: dict = facts["state"]  # answers state queries once the engine is gone
        self.error: str | None = None
        self._conn = conn  # kept open: its EOF tells the engine process this one is gone
        self._ipc_dir = ipc_dir
        self._context, self._commands, self._outputs = context, commands, outputs
        self._handles: dict[int, RemoteRequest] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._rids, self._qids = itertools.count(), itertools.count()
        self._receiver: asyncio.Task | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # ---- start and stop ---------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig, setup: Callable | None = None) -> EngineClient:
        """Spawn the engine process and wait until its engine is built; raises its start-up error.
        `setup(engine)`: a picklable function the engine process runs once the engine is built."""
        ipc_dir = tempfile.mkdtemp(prefix="attnserve-ipc-")  # mode 0700: only this user reaches the sockets
        addresses = (f"ipc://{Path(ipc_dir, 'commands')}", f"ipc://{Path(ipc_dir, 'outputs')}")
        context = zmq.Context()
        commands, outputs = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        for sock, address in ((commands, addresses[0]), (outputs, addresses[1])):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(address)
        mp = multiprocessing.get_context("spawn")
        conn, child_conn = mp.Pipe()
        process = mp.Process(target=run_engine_process, args=(config, addresses, child_conn, setup),
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
            for sock in (commands, outputs):
                sock.close()
            context.term()
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        return cls(process, conn, ipc_dir, context, commands, outputs, payload)

    async def connect(self) -> None:
        """Start reading the engine's output and watching its process, on the running event loop."""
        self._aio = asyncio.get_running_loop()
        self._receiver = asyncio.create_task(self._receive(zmq.asyncio.Socket.from_socket(self._outputs)))
        self._aio.add_reader(self.process.sentinel, self._on_exit)
        if not self.process.is_alive():
            self._on_exit()

    async def aclose(self) -> None:
        """Stop the engine process: its step in flight completes and every open request ends aborted."""
        if self.process.is_alive() and not self._stopping:
            self._stopping = True
            self._send(("shutdown",))
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
            if self.process.is_alive():
                log.warning("the engine process did not stop within %.0f s: killing it", STOP_TIMEOUT_S)
        self._stopping = True
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self._drain()
        self._end_open("the engine process stopped")
        self.release()

    def release(self) -> None:
        """Kill the engine process if it still runs and free the channel (idempotent)."""
        self._stopping = True
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        if self._context.closed:
            return
        if self._aio is not None and not self._aio.is_closed():
            self._aio.remove_reader(self.process.sentinel)
        self._conn.close()
        for sock in (self._commands, self._outputs):
            sock.close()
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping and self.process.is_alive()

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
            self._commands.send(to_wire(cmd), zmq.NOBLOCK)
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
                self._dispatch(from_wire(self._outputs.recv(zmq.NOBLOCK)))
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
        """The engine process ended: read its last messages, then end every open request with the cause."""
        self._aio.remove_reader(self.process.sentinel)
        self.process.join(5)
        self._drain()
        if not self._stopping and self.error is None:
            self.error = exit_description(self.process.exitcode)
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
