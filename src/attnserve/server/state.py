"""What every route of one HTTP process shares: the engine client, the settings, metrics and the engine's facts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from attnserve.server import responses as R
from attnserve.server.engine_client import EngineClient
from attnserve.server.generation import Admission
from attnserve.server.metrics import ServerMetrics


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_request_bytes: int = 8 * 1024 * 1024
    api_workers: int = 1  # HTTP processes sharing the port


class ServerState:
    """Everything the routes share: the engine client, the settings, metrics and the fixed engine facts."""

    def __init__(self, engine: EngineClient, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self.info = {"model": settings.served_model_name, **engine.info}
        self.metrics = ServerMetrics(settings.served_model_name, self.info["attention_backend"]["prefill"],
                                     self.info["attention_backend"]["decode"])
        self.admission = Admission(settings.max_queued_requests)
        self.token_text = R.TokenText(engine.tokenizer)
        self.pool_tokens = engine.pool_tokens  # the most one request can hold
        self.created = int(time.time())
        self.closing = asyncio.Event()  # set when shutdown's grace period is over: open requests end now

    def end_open_requests(self) -> None:
        """Cut every open request short: a stream gets an error event and [DONE], a plain request a 503."""
        self.closing.set()


# ---- request parsing --------------------------------------------------------------------------------


def server_state(request: Request) -> ServerState:
    """The routes' shared state (a FastAPI dependency): create_app puts it on the app."""
    return request.app.state.server


Shared = Annotated[ServerState, Depends(server_state)]  # a route's `state: Shared` parameter
