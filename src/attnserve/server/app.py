"""The OpenAI-compatible HTTP app over the engine process: its start and end, auth and errors; the routes are in
openai_routes.py (the OpenAI API) and ops_routes.py (/health, /server_info, /metrics).

Every error is an OpenAI-style body ({"error": {"message", "type", "param",
"code"}}) with a 4xx for bad input and a 5xx for the server's own failures;
a bad request never disturbs the others.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from attnserve.server import openai_routes, ops_routes
from attnserve.server.protocol import APIError
from attnserve.server.state import ServerSettings, ServerState

__all__ = ["ServerSettings", "ServerState", "create_app"]

log = logging.getLogger("attnserve.server")


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.connect()
        try:
            yield
        finally:
            await state.engine.aclose()

    app = FastAPI(title="attnserve", lifespan=lifespan)
    app.state.server = state  # what the routes read (state.server_state)
    app.state.end_open_requests = state.end_open_requests  # UvicornServer calls it when the grace period ends

    def error_response(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        """The router's own errors (unknown route, wrong method) in the OpenAI shape too."""
        where = f"{request.method} {request.url.path}"
        message, code = {404: (f"no such route: {where}", "not_found"),
                         405: (f"method not allowed: {where}", "method_not_allowed")}.get(
                             exc.status_code, (f"{where}: {exc.detail}", None))
        return error_response(APIError(exc.status_code, message, code=code, headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}", kind="server_error",
                                       code="internal_error"))

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        key = state.settings.api_key
        if key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {key}":
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               kind="authentication_error")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    app.include_router(ops_routes.router)
    app.include_router(openai_routes.router)
    return app
