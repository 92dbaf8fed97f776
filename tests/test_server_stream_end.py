"""A streamed completion whose client goes away while a send waits is aborted and counted when its response ends.

Starlette's StreamingResponse listens for the disconnect beside the sending task and cancels that task when it
comes. Under the app's `http` middleware every send waits until the middleware takes the message, so the cancel
can land there, with the stream's generator suspended at a yield: a StreamingResponse never closes it, and its
completions kept generating, uncounted, until garbage collection finalised it (the flaky abort count of
test_server.py's test_metrics_count_aborted_requests_with_their_finish_reason). These tests drive GroupStream as
uvicorn does (ASGI 2.3) with a send that never returns, garbage collection off.
"""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest

from attnserve.server.generation import Admission, Completion, CompletionGroup
from attnserve.server.openai_routes import GroupStream


class _Engine:
    """EngineClient as a completion group uses it: each submit's sink kept, each abort recorded."""

    def __init__(self):
        self.sinks, self.aborted, self.error = [], [], None

    def submit(self, prompt_ids, params, sink, speculative):
        self.sinks.append(sink)
        accepted = asyncio.get_running_loop().create_future()
        accepted.set_result(None)
        return SimpleNamespace(rid=len(self.sinks), stream=SimpleNamespace(finished=False), accepted=accepted,
                               process=lambda item: item)

    def abort(self, rid):
        self.aborted.append(rid)


class _Chunks:
    """One SSE line per event, nothing before or after."""

    def start(self):
        return []

    def event(self, choice, event):
        return [f"data: {event.text}\n\n"]

    def end(self, finished):
        return []


async def _cut_stream(waiting_send: str):
    """Serve one streamed completion whose `waiting_send` ("start" or "body") never returns; the client
    disconnects as it is sent. Returns the engine's aborts and the unfinished reasons counted."""
    engine, counted = _Engine(), []
    state = SimpleNamespace(metrics=SimpleNamespace(ended_without_output=counted.append, observe=lambda o: None))
    group = await CompletionGroup.submit(engine, [Completion(0, [1, 2, 3], None)], Admission(None))
    for text in ("a", "b", "c"):  # tokens already produced, never finishing
        engine.sinks[0](SimpleNamespace(text=text, finished=False))
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == f"http.response.{waiting_send}":
            gone.set()  # the client goes away while this send waits for the middleware, which never takes it
            await asyncio.Event().wait()

    response = GroupStream(state, group, SimpleNamespace(receive=receive), _Chunks())
    await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send), 10)
    return list(engine.aborted), list(counted)  # as the response ended (asyncio.run closes what is left later)


@pytest.mark.parametrize("waiting_send", ["start", "body"])
def test_a_stream_cut_while_a_send_waits_is_aborted_and_counted_at_once(waiting_send):
    gc.disable()  # nothing left to garbage collection
    try:
        aborts, counted = asyncio.run(_cut_stream(waiting_send))
    finally:
        gc.enable()
    assert aborts == [1]  # the completion is aborted once (its pages freed in the engine's next step)
    assert counted == [["abort"]]  # and counted once, as aborted
