"""Every message between the HTTP processes, the supervisor and the engine process survives the wire whole, and
an unknown one is reported by both ends instead of being read by position."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from attnserve.engine.outputs import TokenDelta
from attnserve.engine.sampling_params import SamplingParams
from attnserve.server import wire

PARAMS = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n"])
MESSAGES = [
    wire.AddRequest(4, [1, 2, 3], PARAMS, speculative=False),
    wire.Abort(4),
    wire.StopRequest(4, "\n"),
    wire.StateQuery(9),
    wire.ClientGone(b"worker-1-2"),
    wire.Shutdown(),
    wire.RequestItem(4, None),
    wire.RequestItem(4, ValueError("prompt token ids must be in [0, 50)")),
    wire.Accepted(4),
    wire.StateReply(9, {"running": 1, "waiting": 0, "stats": {"steps": 12}}),
    wire.EngineFailed("RuntimeError('device lost')"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips(message):
    back = wire.from_wire(wire.to_wire(message))
    assert type(back) is type(message)
    for field in dataclasses.fields(message):
        a, b = getattr(message, field.name), getattr(back, field.name)
        if isinstance(a, BaseException):
            assert type(a) is type(b) and a.args == b.args
        else:
            assert a == b, field.name


def test_a_token_delta_travels_inside_an_item():
    delta = TokenDelta(token_ids=(5, 6), times=(1.0, 2.0), logprobs=None, cached_tokens=3, num_preemptions=1,
                       finish_reason="length", spec_draft_tokens=4)
    (back,) = wire.from_wire(wire.to_wire([wire.RequestItem(1, delta)]))
    assert back.item == delta


def test_both_ends_name_a_message_they_do_not_know(caplog):
    from attnserve.server.engine_client import EngineClient

    client = EngineClient.__new__(EngineClient)
    with caplog.at_level(logging.WARNING, logger="attnserve.server"):
        client._dispatch([("item", 1, None)])  # the old tuple form: no longer read by position
    assert "unknown message from the engine" in caplog.text
