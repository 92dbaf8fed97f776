"""An HTTP process's end of the engine process: stream requests through it, notice its end.

As in SGLang, the process that serves HTTP tokenizes prompts and detokenizes
outputs, and the scheduler and model run in a process of their own
(engine_process.py), so JSON, SSE and text never take the GIL from a step.
Requests go over as token ids with their SamplingParams; token deltas come back
and a RequestStream per completion makes their text here.

The process that owns the engine (engine_owner.py) spawns it and waits until it
is built, so a start-up error is raised before a port is bound. A one-process
server's HTTP side talks to it through `EngineClient.of(owner)`; with
--api-workers, each worker makes its own `EngineClient.attach` over the same
engine, which the supervisor owns (api_workers.py). Inside the server's event
loop, `connect` starts reading the socket and watching the engine's end (the
process itself where this process owns it, the supervisor's word in a worker):
when it ends, every open request ends with an error that names the cause and
`alive` turns False. `aclose` stops the engine cleanly (as its owner) or leaves
it (a worker); `release` frees the channel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from attnserve.engine.loop import Item, RequestHandle
from attnserve.engine.outputs import RequestStream
from attnserve.engine.sampling_params import SamplingParams
from attnserve.models.tokenizer import encode
from attnserve.server.engine_owner import STOP_TIMEOUT_S, EngineProcess, dealer
from attnserve.server.wire import (
    Abort,
    Accepted,
    AddRequest,
    EngineFailed,
    RequestItem,
    StateQuery,
    StateReply,
    StopRequest,
    ToEngine,
    from_wire,
    to_wire,
)

log = logging.getLogger("attnserve.server")

QUERY_TIMEOUT_S = 30.0  # a state query unanswered this long returns the last state read


class RemoteRequest(RequestHandle):
    """A request submitted to the engine process; `accepted` resolves when the engine queued it, or raises
    what the engine refused it with (ValueError for bad input)."""

    def __init__(self, client: EngineClient, rid: int, stream: RequestStream, sink: Callable[[Item], None]):
        super().__init__(client, rid, stream, sink)
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        # a refusal that nobody awaits (its group failed earlier) is not an error worth a warning
        self.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())


class EngineClient:
    """One channel to the engine process; used from the HTTP server's event loop once `connect`ed. In a
    one-process server it is made with `of(owner)` and watches the process itself; in an API worker, with
    `attach`, and it watches `engine_end`, a pipe on which the supervisor sends ("engine_exit", why) and whose
    EOF means the supervisor is gone."""

    def __init__(self, channel_dir: str, facts: dict, identity: bytes, owner: EngineProcess | None = None,
                 engine_end=None):
        self.owner = owner
        self.pid: int = facts["pid"]
        self.tokenizer = facts["tokenizer"]
        self.chat_template: str | None = facts["chat_template"]
        self.max_context_len: int = facts["max_context_len"]
        self.pool_tokens: int = facts["pool_tokens"]
        self.info: dict = facts["info"]
        self.last_state: dict = facts["state"]  # answers state queries once the engine is gone
        self.error: str | None = None
        self._engine_end = engine_end
        self._context = zmq.Context()
        self._sock = dealer(channel_dir, self._context, identity)
        # every send and receive goes through this asyncio view of the socket, on the event loop's thread (see
        # `connect`): ZeroMQ's descriptor signals edges, and an operation made outside the view can consume
        # the edge of a message that has arrived, so that its reader never wakes
        self._io: zmq.asyncio.Socket | None = None
        self._handles: dict[int, RemoteRequest] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._rids, self._qids = itertools.count(), itertools.count()
        self._receiver: asyncio.Task | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._watched: int | None = None  # the file descriptor the event loop watches for the engine's end
        self._stopping = False
        self._ended = False  # the engine process is known to have ended
        self._exited: asyncio.Event | None = None  # with an owner: set once the event loop has reaped the process
        self.exitcode: int | None = None  # with an owner: the process's, once reaped

    # ---- start and stop ---------------------------------------------------------------------
    @classmethod
    def of(cls, owner: EngineProcess) -> EngineClient:
        """The channel of the process that owns the engine (a one-process server's)."""
        return cls(owner.channel_dir, owner.facts, f"http-{os.getpid()}".encode(), owner=owner)

    @classmethod
    def attach(cls, channel_dir: str, facts: dict, engine_end, identity: bytes) -> EngineClient:
        """A client of an engine process that another process owns (an API worker's), named `identity` on the
        engine's socket (unique per worker the owner starts)."""
        return cls(channel_dir, facts, identity, engine_end=engine_end)

    async def connect(self) -> None:
        """Start reading the engine's output and watching its end, on the running event loop."""
        self._aio = asyncio.get_running_loop()
        self._io = zmq.asyncio.Socket.from_socket(self._sock)
        self._receiver = asyncio.create_task(self._receive())
        if self.owner is not None:
            self._exited = asyncio.Event()
            self._watched = self.owner.process.sentinel
            self._aio.add_reader(self._watched, self._on_exit)
            if not self.owner.process.is_alive():
                self._on_exit()
        else:
            self._watched = self._engine_end.fileno()
            self._aio.add_reader(self._watched, self._on_owner_message)

    async def aclose(self) -> None:
        """Stop the engine process (with an owner) or leave it (a worker); every request still open here ends.
        The owner's process is reaped on the event loop's thread only (`_on_exit`)."""
        if self.owner is not None and not self._exited.is_set():
            self._stopping = True
            self.owner.request_stop()
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
        """Free the channel (idempotent); the process is its owner's to release."""
        self._stopping = True
        if self._context.closed:
            return
        if self._watched is not None and self._aio is not None and not self._aio.is_closed():
            self._aio.remove_reader(self._watched)
        if self._io is not None:
            self._io.close()  # stops the event loop's watch of the socket
        self._sock.close()
        self._context.term()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping and not self._ended

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
        self._send(AddRequest(rid, prompt_ids, params, speculative))
        return handle

    def abort(self, rid: int) -> None:
        self._send(Abort(rid))

    def stop_request(self, rid: int, stop: str) -> None:
        self._send(StopRequest(rid, stop))

    async def state(self) -> dict:
        """The engine's requests, KV pages and counters now (the last ones read once it is gone)."""
        if not self.alive:
            return self.last_state
        qid = next(self._qids)
        future = self._queries[qid] = asyncio.get_running_loop().create_future()
        self._send(StateQuery(qid))
        try:
            return await asyncio.wait_for(future, QUERY_TIMEOUT_S)
        except (RuntimeError, TimeoutError):
            return self.last_state
        finally:
            self._queries.pop(qid, None)

    def _send(self, cmd: ToEngine) -> None:
        """Queue `cmd` for the engine (the send queue has no limit, so it goes at once). Through the asyncio
        view: after the send it looks again for messages that arrived meanwhile, which a send on the plain
        socket would leave unread until the next message, and the next may never come. Nothing is sent once the
        channel is released (the engine's end, or this server's, is being handled)."""
        if self._io.closed:
            return
        self._io.send(to_wire(cmd)).add_done_callback(self._sent)

    @staticmethod
    def _sent(future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is not None:  # a closed channel: its end is handled
            log.warning("a command to the engine was not sent: %r", future.exception())

    # ---- what comes back --------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            self._dispatch(from_wire(await self._io.recv()))

    def _drain(self) -> None:
        """Read what is left on the socket without waiting (the engine process has ended)."""
        if self._io is None:
            return
        while True:
            try:
                data = self._io.recv(zmq.NOBLOCK).result()  # resolved at once: a message, or Again
            except zmq.Again:
                return
            self._dispatch(from_wire(data))

    def _dispatch(self, events: list) -> None:
        for event in events:
            match event:
                case RequestItem(rid=rid, item=item):
                    handle = self._handles.get(rid)
                    if handle is None:
                        continue
                    if item is None:
                        del self._handles[rid]
                    elif not handle.accepted.done():
                        if isinstance(item, BaseException):  # refused
                            handle.accepted.set_exception(item)
                            continue
                        handle.accepted.set_result(None)  # queued as the engine stopped: it ends aborted
                    handle.deliver(item)
                case Accepted(rid=rid):
                    handle = self._handles.get(rid)
                    if handle is not None and not handle.accepted.done():
                        handle.accepted.set_result(None)
                case StateReply(qid=qid, state=state):
                    self.last_state = state
                    future = self._queries.get(qid)
                    if future is not None and not future.done():
                        future.set_result(state)
                case EngineFailed(reason=reason):
                    self.error = self.error or f"the engine failed: {reason}"
                    log.error("%s; new requests are refused", self.error)
                case _:
                    log.warning("unknown message from the engine: %r", event)

    def _on_exit(self) -> None:
        """The engine process ended (its owner, this process, sees it): read its last messages, then end every
        open request with the cause."""
        self._aio.remove_reader(self._watched)
        self._watched = None
        self.owner.process.join(5)  # reaped on this thread only: a second thread's waitpid could see no exit code
        self.exitcode = self.owner.process.exitcode
        self._exited.set()
        self.engine_ended(self.owner.exit_reason())

    def _on_owner_message(self) -> None:
        """A worker hears from the engine's owner: the engine ended (and why), or, at EOF, the owner is gone
        and so is this server (its graceful shutdown starts, as on SIGTERM)."""
        try:
            kind, reason = self._engine_end.recv()
        except (EOFError, OSError):
            self._aio.remove_reader(self._watched)
            self._watched = None
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
