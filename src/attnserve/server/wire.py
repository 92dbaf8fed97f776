"""The messages between an HTTP process (or the supervisor) and the engine process, one dataclass each.

Both ends import these classes, so a field is named where it is sent and where it is read, and a message one
end does not know is an error that names it instead of a tuple read by position. They travel pickled (both
ends are the same program on one machine, over sockets in a private directory), whole dataclasses inside them
included (SamplingParams, TokenDelta), so a field added to those travels without changes here.

Client -> engine: AddRequest, Abort, StopRequest, StateQuery; owner -> engine: ClientGone, Shutdown.
Engine -> client: a list of RequestItem, Accepted, StateReply and EngineFailed per loop iteration.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from attnserve.engine.sampling_params import SamplingParams


# ---- to the engine --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """Queue a request; `rid` is the client's own id, which every reply about it carries."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    speculative: bool = True


@dataclass(frozen=True)
class Abort:
    rid: int


@dataclass(frozen=True)
class StopRequest:
    """End the request as if it had generated `stop` (a stop string the client's detokenizer found)."""

    rid: int
    stop: str


@dataclass(frozen=True)
class StateQuery:
    """Ask for the engine's requests, KV pages and counters; answered by a StateReply with the same `qid`."""

    qid: int


@dataclass(frozen=True)
class ClientGone:
    """From the engine's owner: the client process named `identity` died, so its requests end."""

    identity: bytes


@dataclass(frozen=True)
class Shutdown:
    """From the engine's owner: finish the step in flight, end every open request, exit."""


# ---- from the engine ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestItem:
    """What the engine produced for request `rid`: a TokenDelta, an exception (ValueError: refused as bad input),
    or None (nothing more will come)."""

    rid: int
    item: Any


@dataclass(frozen=True)
class Accepted:
    rid: int


@dataclass(frozen=True)
class StateReply:
    qid: int
    state: dict


@dataclass(frozen=True)
class EngineFailed:
    """The engine's loop failed; no request will progress any more."""

    reason: str


ToEngine = AddRequest | Abort | StopRequest | StateQuery | ClientGone | Shutdown
FromEngine = RequestItem | Accepted | StateReply | EngineFailed


def to_wire(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def from_wire(data: bytes):
    return pickle.loads(data)
