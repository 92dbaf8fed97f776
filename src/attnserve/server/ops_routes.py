"""The server's own routes, beside the OpenAI API: /health (503 once the engine is gone), /server_info (the
engine's facts and state now, the processes), /metrics (Prometheus)."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from attnserve.server.protocol import APIError
from attnserve.server.state import Shared

router = APIRouter()


@router.get("/health")
async def health(state: Shared):
    if state.engine.alive:
        return Response(status_code=200)
    return JSONResponse(APIError(503, f"the engine is not running: {state.engine.error or 'it has stopped'}",
                                 kind="server_error").body(), status_code=503)


@router.get("/server_info")
async def server_info(state: Shared):
    live = await state.engine.state()
    return {**state.info, "kv_cache": live["kv_cache"], "running": live["running"], "waiting": live["waiting"],
            "queued_in_server": state.admission.queued, "prefix_cache": live["prefix_cache"],
            "engine_steps": {"by_mode": live["stats"].get("steps_by_mode", {}),
                             "seconds_by_mode": live["stats"].get("step_seconds_by_mode", {})},
            **({"speculative_stats": live["stats"]["speculative"]} if "speculative" in live["stats"] else {}),
            "processes": {"http": os.getpid(), "engine": state.engine.pid,
                          "api_workers": state.settings.api_workers}}


@router.get("/metrics")
async def metrics(state: Shared):
    body = state.metrics.render(await state.engine.state())
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
