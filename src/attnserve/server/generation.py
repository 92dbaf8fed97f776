"""Running requests from asyncio: the completions of one HTTP request, sent to the engine process.

Each completion is submitted to the EngineClient with a sink that puts its
items (token deltas from the engine process, read on this event loop) on a
queue, so a coroutine awaits tokens without a thread per request. The
completions of one HTTP request (several prompts, n each) share one queue and
come out merged, tagged with their choice index. Submitting waits until the
engine accepted every completion, so bad input is refused before a stream's
headers are sent. Whatever ends the reading early (the client going away, an
error, shutdown) aborts every completion still running, which frees its pages
in the next engine step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from attnserve.engine.outputs import StreamEvent
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server.engine_client import EngineClient, RemoteRequest
from attnserve.server.protocol import APIError


@dataclass
class Completion:
    choice: int  # index in the response's choices
    prompt_ids: list[int]
    params: SamplingParams
    speculative: bool = True  # False: the engine never drafts for it


class ClientGone(Exception):
    """The client disconnected; its completions were aborted."""


class ServerClosing(Exception):
    """The server is shutting down and its grace period ran out; the completions were aborted."""


class Admission:
    """Counts completions submitted but not yet generating, to refuse work past --max-queued-requests."""

    def __init__(self, max_queued: int | None):
        self.max_queued = max_queued
        self.queued = 0

    def admit(self, n: int) -> None:
        if self.max_queued is not None and self.queued + n > self.max_queued:
            raise APIError(503, f"the server has {self.queued} requests queued (limit {self.max_queued}); "
                           "retry later", kind="server_overloaded", headers={"Retry-After": "1"})
        self.queued += n


async def _disconnected(receive) -> None:
    """Returns when the client disconnects (the request body has been read, so only that message is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class CompletionGroup:
    """The completions of one HTTP request, submitted together and read as one merged stream."""

    def __init__(self, engine: EngineClient, completions: list[Completion], admission: Admission,
                 closing: asyncio.Event | None = None):
        """`closing`: set when the server cuts open requests short (the reader gets ServerClosing)."""
        self.engine = engine
        self.admission = admission
        self.closing = closing
        self.failed: set[int] = set()  # choices that failed in the engine
        self._closed = False
        self._ended = False
        self._inbox: asyncio.Queue = asyncio.Queue()
        self.handles: dict[int, RemoteRequest] = {}
        admission.admit(len(completions))
        self._starting = {c.choice for c in completions}  # counted as queued until their first item
        try:
            for c in completions:
                self.handles[c.choice] = engine.submit(c.prompt_ids, c.params, self._sink(c.choice), c.speculative)
        except BaseException:
            self.close()
            raise

    @classmethod
    async def submit(cls, engine: EngineClient, completions: list[Completion], admission: Admission,
                     closing: asyncio.Event | None = None) -> CompletionGroup:
        """The group once the engine accepted every completion; raises ValueError for input it refused,
        RuntimeError when it is not running."""
        group = cls(engine, completions, admission, closing)
        results = await asyncio.gather(*(h.accepted for h in group.handles.values()), return_exceptions=True)
        refusal = next((r for r in results if isinstance(r, BaseException)), None)
        if refusal is not None:
            group.close()
            raise refusal
        return group

    def _sink(self, choice: int):
        return lambda item: self._inbox.put_nowait((choice, item))

    async def events(self, receive=None) -> AsyncIterator[tuple[int, StreamEvent]]:
        """(choice, event) until every completion finished. Raises RequestFailed / RuntimeError when a
        completion or the engine fails, ClientGone when `receive` (ASGI) reports a disconnect, ServerClosing
        when the server cuts open requests short."""
        watchers = set()
        if receive is not None:
            watchers.add(asyncio.ensure_future(_disconnected(receive)))
        if self.closing is not None:
            watchers.add(asyncio.ensure_future(self.closing.wait()))
        open_choices = set(self.handles)
        try:
            while open_choices:
                getter = asyncio.ensure_future(self._inbox.get())
                if watchers:
                    await asyncio.wait({getter, *watchers}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        if self.closing is not None and self.closing.is_set():
                            raise ServerClosing()
                        raise ClientGone()
                choice, item = await getter
                self._started(choice)
                handle = self.handles[choice]
                if item is None:  # ended without finishing: the engine loop stopped under it
                    if not handle.stream.finished:
                        raise RuntimeError("the engine stopped before the request finished")
                    open_choices.discard(choice)
                    continue
                try:
                    event = handle.process(item)
                except BaseException:
                    self.failed.add(choice)
                    raise
                if event is not None:
                    yield choice, event
                if handle.stream.finished:
                    open_choices.discard(choice)
        finally:
            for watcher in watchers:
                watcher.cancel()
            self.close()

    def unfinished_reasons(self) -> list[str]:
        """The finish reason of each completion that ended without an output: "error" where it (or the
        engine) failed, "abort" where it was cut short (a disconnect, another completion's failure, shutdown)."""
        engine_failed = self.engine.error is not None
        return ["error" if choice in self.failed or engine_failed else "abort"
                for choice, handle in self.handles.items() if not handle.stream.finished]

    def _started(self, choice: int) -> None:
        if choice in self._starting:
            self._starting.discard(choice)
            self.admission.queued -= 1

    def close(self) -> None:
        """Abort what is still running; release the queue slots of what never started (once)."""
        if self._closed:
            return
        self._closed = True
        self.admission.queued -= len(self._starting)
        self._starting.clear()
        for handle in self.handles.values():
            if not handle.stream.finished:
                self.engine.abort(handle.rid)

    def end(self, count_unfinished) -> None:
        """The reading is over: close, and give `count_unfinished` the finish reasons of the completions that ended
        without an output, once (a stream's generator and its response both end it, whichever comes first)."""
        self.close()
        if not self._ended:
            self._ended = True
            count_unfinished(self.unfinished_reasons())
