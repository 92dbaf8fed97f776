"""EngineLoop: the engine stepping in a background thread, fed and aborted from any thread.

A server handles each HTTP request in its own coroutine or thread; the engine
itself is single-threaded. The loop owns the engine: other threads only put
commands (add, abort) on a queue and read events from their request's own
queue, so the scheduler's state is touched by one thread alone.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from attnserve.engine.detokenizer import Detokenizer
from attnserve.engine.engine import Engine
from attnserve.engine.llm import RequestOutput, StreamEvent
from attnserve.engine.sampling_params import SamplingParams

log = logging.getLogger("attnserve.engine")


@dataclass
class RequestHandle:
    rid: int
    events: queue.Queue  # StreamEvent, then None once the request is finished or failed

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            ev = self.events.get()
            if ev is None:
                return
            if isinstance(ev, Exception):
                raise ev
            yield ev

    def result(self) -> RequestOutput | None:
        """Block until the request ends; its final output (None if it was aborted before a token)."""
        last = None
        for ev in self:
            last = ev
        return last.output if last is not None and last.finished else None


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}
        self._sent_tokens: dict[int, int] = {}
        self._rids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()  # a submit either lands before the loop ends or raises
        self._thread = threading.Thread(target=self._run, name="attnserve-engine", daemon=True)
        self.error: BaseException | None = None

    # ---- any thread -------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and end the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestHandle:
        with self._submit_lock:
            if self.error is not None:
                raise RuntimeError(f"the engine loop failed: {self.error!r}") from self.error
            if self._stop.is_set():
                raise RuntimeError("the engine loop has stopped")
            handle = RequestHandle(next(self._rids), queue.Queue())
            self._commands.put(("add", handle, prompt, params or SamplingParams()))
        self._wake.set()
        return handle

    def abort(self, rid: int) -> None:
        self._commands.put(("abort", rid))
        self._wake.set()

    # ---- the loop thread --------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, handle, prompt, params = cmd
                try:
                    self.engine.add_request(prompt, params, rid=handle.rid)
                except Exception as exc:  # noqa: BLE001 - bad input goes back to its submitter
                    handle.events.put(exc)
                    handle.events.put(None)
                    continue
                self._handles[handle.rid] = handle
                self._sent_tokens[handle.rid] = 0
            else:
                rid = cmd[1]
                if self.engine.abort(rid):
                    self._close(rid)

    def _close(self, rid: int) -> None:
        handle = self._handles.pop(rid, None)
        self._sent_tokens.pop(rid, None)
        if handle is not None:
            handle.events.put(None)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for req in self.engine.step():
                    handle = self._handles.get(req.rid)
                    if handle is None:
                        continue
                    new_ids = req.output_ids[self._sent_tokens[req.rid]:]
                    self._sent_tokens[req.rid] = len(req.output_ids)
                    out = RequestOutput.from_request(req, 0, 0) if req.finished else None
                    handle.events.put(StreamEvent(0, 0, Detokenizer.streamable(req), new_ids, req.finished, out))
                    if req.finished:
                        self._close(req.rid)
        except BaseException as exc:  # every waiter must hear about a dead loop
            with self._submit_lock:
                self.error = exc
                self._stop.set()
            failed = [*self._handles.values(), *self._queued_handles()]
            for handle in failed:
                handle.events.put(RuntimeError(f"engine loop failed: {exc!r}"))
                handle.events.put(None)
            self._handles.clear()
            log.error("engine loop failed; new requests are refused", exc_info=exc)
        finally:
            with self._submit_lock:
                self._stop.set()
            for handle in self._queued_handles():  # submitted while stopping: ends without output
                handle.events.put(None)
            for rid in list(self._handles):
                try:
                    self.engine.abort(rid)
                finally:
                    self._close(rid)

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
