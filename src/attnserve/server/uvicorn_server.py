"""uvicorn's Server, with what a model server needs from its start and stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

log = logging.getLogger("attnserve.server")

END_GRACE_S = 5.0  # after open requests are told to end: how long they may take to send their last bytes


def announce_serving(host: str, port: int, detail: str = "") -> None:
    """The line that says the server is up, and where (scripts and tests wait for it)."""
    log.info("serving on http://%s:%s (OpenAI API under /v1; /health, /metrics, /server_info)%s", host, port, detail)


class UvicornServer(uvicorn.Server):
    """Logs the address really bound (--port 0 picks one), or tells `on_started(host, port)` (an API worker
    tells its supervisor, which logs it once for all); treats a shutdown that SIGINT/SIGTERM started as a
    normal exit (status 0) instead of re-raising the signal once shut down; and when open requests outlast the
    graceful-shutdown timeout, asks the app to end them (`app.state.end_open_requests`: a stream then sends an
    error event and `data: [DONE]`) before anything is cancelled."""

    def __init__(self, config: uvicorn.Config, on_started=None):
        super().__init__(config)
        self.on_started = on_started or announce_serving

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started(*self.servers[0].sockets[0].getsockname()[:2])

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:
                if self._captured_signals:
                    log.info("shutting down (signal %d): finishing open streams", self._captured_signals[0])
                self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, with the app ending its open requests itself once the timeout is over."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await asyncio.sleep(0.1)
        done = await self._settled_within(self.config.timeout_graceful_shutdown)
        end = getattr(getattr(self.config.app, "state", None), "end_open_requests", None)
        if not done and end is not None:
            log.warning("graceful shutdown timeout (%s s) exceeded: ending %d open request(s) with an error",
                        self.config.timeout_graceful_shutdown, len(self.server_state.tasks))
            end()
            done = await self._settled_within(END_GRACE_S)
        if not done:
            log.error("cancelling %d request(s) that did not end", len(self.server_state.tasks))
            for t in self.server_state.tasks:
                t.cancel(msg="graceful shutdown timeout exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _settled_within(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds (None: no limit) for every connection and request task to end."""
        try:
            async with asyncio.timeout(timeout):
                await self._wait_tasks_to_complete()
        except TimeoutError:
            return False
        return True
