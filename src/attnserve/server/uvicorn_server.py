"""uvicorn's Server, with the two things a model server needs from its start and stop."""

from __future__ import annotations

import contextlib
import logging

import uvicorn

log = logging.getLogger("attnserve.server")


class UvicornServer(uvicorn.Server):
    """Logs the address really bound (--port 0 picks one), and treats a shutdown that SIGINT/SIGTERM
    started as a normal exit (status 0) instead of re-raising the signal once shut down."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            log.info("serving on http://%s:%s (OpenAI API under /v1; /health, /metrics, /server_info)", host, port)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                if self._captured_signals:
                    log.info("shutting down (signal %d): finishing open streams", self._captured_signals[0])
                self._captured_signals.clear()
