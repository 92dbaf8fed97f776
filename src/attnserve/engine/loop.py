"""EngineLoop: the engine stepping in a background thread, fed and aborted from any thread.

A server handles each HTTP request in its own coroutine or thread; the engine
itself is single-threaded. The loop owns the engine: other threads put
commands (add, abort, stop, query) on a queue and read their request's events,
so the scheduler's state is touched by one thread alone. The step thread works
in token ids only: prompts are tokenized and validated by the submitting thread
(`submit` raises ValueError for bad input before anything is queued), and text
is decoded by each request's consumer (`RequestHandle`). The server runs the
loop on the main thread of its engine process instead, with commands read from
the HTTP process's socket (server/engine_process.py).

Failures: a request that fails inside a step is failed alone (its consumer gets
`RequestFailed` with the reason, its pages are freed); only a failure of the
step itself ends the loop, and then every waiter hears about it.

Stopping completes the step in flight and aborts every request still open (its
consumer gets a final event with finish reason "abort"), so the engine is idle
afterwards, its pages free, and can be stepped again.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator

from attnserve.engine.engine import Engine
from attnserve.engine.outputs import RequestOutput, RequestStream, StreamEvent, TokenDelta
from attnserve.engine.request import FinishReason
from attnserve.engine.sampling_params import SamplingParams

log = logging.getLogger("attnserve.engine")

# What a handle receives, in order: TokenDelta per step with new tokens, then None (the end), or an
# exception (the request or the loop failed) followed by None.
Item = TokenDelta | BaseException | None

# what a request the loop never picked up receives when the loop stops: it ends aborted, with no tokens
_ABORTED = TokenDelta(token_ids=(), times=(), logprobs=None, cached_tokens=0, num_preemptions=0,
                      finish_reason=FinishReason.ABORT)


class RequestHandle:
    """One submitted request. Its consumer reads events by iterating (a thread), or passes `sink` to
    `submit` and calls `process` on each delivered item (a coroutine: the sink hops to its event loop)."""

    def __init__(self, loop: EngineLoop, rid: int, stream: RequestStream, sink: Callable[[Item], None] | None):
        self.rid = rid
        self.stream = stream
        self._loop = loop
        self._queue: queue.SimpleQueue | None = None if sink is not None else queue.SimpleQueue()
        self.deliver: Callable[[Item], None] = sink if sink is not None else self._queue.put

    def process(self, item: TokenDelta | BaseException) -> StreamEvent | None:
        """The event for one delivered item (None when it adds nothing); raises the request's failure."""
        if isinstance(item, BaseException):
            raise item
        event = self.stream.push(item)
        if self.stream.stop_hit:  # the text reached a stop string: the engine can stop generating
            self.stream.stop_hit = False
            self._loop.stop_request(self.rid, self.stream.output.matched_stop)
        return event

    def __iter__(self) -> Iterator[StreamEvent]:
        return self.events()

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Events until the request ends; `timeout` seconds without one raises TimeoutError."""
        if self._queue is None:
            raise RuntimeError("this request's events go to its sink")
        while not self.stream.finished:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.rid}: no event for {timeout} s") from None
            if item is None:
                return  # aborted (or the loop stopped) before it finished
            event = self.process(item)
            if event is not None:
                yield event

    def result(self, timeout: float | None = None) -> RequestOutput | None:
        """Block until the request ends; its final output (None if it was aborted first)."""
        for _ in self.events(timeout):
            pass
        return self.stream.output


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}  # loop thread only
        self._sent_tokens: dict[int, int] = {}  # loop thread only
        self._rids = itertools.count()
        self._lock = threading.Lock()  # a submit either lands before the loop ends or raises
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self.error: BaseException | None = None

    # ---- any thread -------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread: the step in flight completes, every open request ends with finish reason "abort",
        and the engine is left idle (reusable by a new loop or directly)."""
        with self._lock:
            self._stopping = True
        self._commands.put(("shutdown",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine loop did not stop within %.0f s: its engine is still in use", timeout)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               sink: Callable[[Item], None] | None = None) -> RequestHandle:
        """Validate and tokenize here (ValueError for bad input), then queue the request for the loop."""
        rid = next(self._rids)
        req = self.engine.make_request(prompt, params, rid=rid)
        stream = RequestStream(self.engine.tokenizer, req.params, req.prompt, req.prompt_ids, req.arrival_time)
        handle = RequestHandle(self, rid, stream, sink)
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"the engine loop failed: {self.error!r}") from self.error
            if self._stopping:
                raise RuntimeError("the engine loop has stopped")
            self._commands.put(("add", handle, req))
        return handle

    def abort(self, rid: int) -> None:
        self._commands.put(("abort", rid))

    def stop_request(self, rid: int, stop: str) -> None:
        self._commands.put(("stop", rid, stop))

    def query(self, fn: Callable[[Engine], object], timeout: float = 10.0):
        """fn(engine) run on the loop thread between steps (a consistent view); its result."""
        if not self._thread.is_alive():
            return fn(self.engine)  # nothing else touches the engine any more
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("query", fn, future))
        return future.result(timeout)

    # ---- the loop thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_work()):
                if self.engine.has_work():
                    self._step()
        except BaseException as exc:  # every waiter must hear about a dead loop
            with self._lock:
                self.error = exc
                self._stopping = True
            log.error("engine loop failed; new requests are refused", exc_info=exc)
            for handle in [*self._handles.values(), *self._queued_handles()]:
                handle.deliver(RuntimeError(f"engine loop failed: {exc!r}"))
                handle.deliver(None)
            self._handles.clear()
        finally:
            with self._lock:
                self._stopping = True
            for handle in self._queued_handles():  # submitted while stopping: ends aborted, without output
                handle.deliver(_ABORTED)
                handle.deliver(None)
            self._settle()

    def _settle(self) -> None:
        """Leave the engine idle and reusable: complete the step in flight (its tokens still reach their
        handles), then abort every request still open, each handle ending with finish reason "abort"."""
        try:
            self._deliver(self.engine.drain())
        except Exception as exc:  # noqa: BLE001 - the step's requests are aborted below all the same
            log.warning("the step in flight failed while the engine loop stopped: %r", exc)
        for rid in list(self._handles):
            req = self.engine.requests.get(rid)
            try:
                self.engine.abort(rid)
            finally:
                handle = self._handles.get(rid)
                if handle is not None and req is not None and req.finished:
                    handle.deliver(TokenDelta.of(req, self._sent_tokens[rid]))
                self._close(rid)
        try:
            for rid in list(self.engine.requests):  # the loop failed: its requests' handles already heard why
                self.engine.abort(rid)
        except Exception as exc:  # noqa: BLE001 - a failed engine may not free cleanly; the loop ends anyway
            log.warning("aborting the requests of a failed engine: %r", exc)

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once asked to shut down."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            kind = cmd[0]
            if kind == "shutdown":
                return False
            if kind == "add":
                self._add(cmd[1], cmd[2])
            elif kind == "abort":
                if self.engine.abort(cmd[1]):
                    self._close(cmd[1])
            elif kind == "stop":
                self.engine.stop_request(cmd[1], cmd[2])
                self._close(cmd[1])
            elif kind == "query":
                fn, future = cmd[1], cmd[2]
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - the asker gets it
                    future.set_exception(exc)

    def _add(self, handle: RequestHandle, req) -> None:
        try:
            self.engine.add(req)
        except BaseException as exc:  # bad input goes back to its submitter; the loop goes on
            handle.deliver(exc)
            handle.deliver(None)
            if not isinstance(exc, Exception):
                raise
            return
        self._handles[handle.rid] = handle
        self._sent_tokens[handle.rid] = 0

    def _step(self) -> None:
        self._deliver(self.engine.step())

    def _deliver(self, reqs) -> None:
        for req in reqs:
            handle = self._handles.get(req.rid)
            if handle is None:
                continue
            handle.deliver(TokenDelta.of(req, self._sent_tokens[req.rid]))
            self._sent_tokens[req.rid] = len(req.output_ids)
            if req.finished:
                self._close(req.rid)

    def _close(self, rid: int) -> None:
        handle = self._handles.pop(rid, None)
        self._sent_tokens.pop(rid, None)
        if handle is not None:
            handle.deliver(None)

    def _queued_handles(self) -> list[RequestHandle]:
        """Take every submitted request the loop has not picked up yet (once no submit can add more)."""
        handles = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return handles
            if cmd[0] == "add":
                handles.append(cmd[1])
            elif cmd[0] == "query":
                cmd[2].set_exception(RuntimeError("the engine loop has stopped"))
