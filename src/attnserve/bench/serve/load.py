"""Load shapes: a closed loop of N clients, or an open loop of Poisson arrivals.

Closed loop (`concurrency`): N clients, each sending its next request the moment
its last one ends, so exactly N are in flight until the queue drains. Open loop
(`rate`): requests arrive at random intervals of mean 1/rate whatever the server's
state (`inf`: all at once); the intervals are exponential (a Poisson process), or with
`burstiness` b gamma-distributed with shape b and scale 1/(rate * b), as `vllm bench
serve --burstiness` draws them (b < 1: bursts and lulls, b > 1: more even than Poisson).
Either way a point may be given a time budget; when it runs out, requests still in
flight are cancelled and marked `cut`, and requests never sent are not counted.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from attnserve.bench.serve.client import RequestResult, RequestSpec, send
from attnserve.bench.serve.datasets import BenchRequest


@dataclass(frozen=True)
class LoadPoint:
    kind: str  # "concurrency" (closed loop) or "rate" (open loop, requests/s)
    value: float

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        return "rate inf" if math.isinf(self.value) else f"rate {self.value:g}/s"


def arrival_gaps(rng: np.random.Generator, rate: float, burstiness: float, num: int) -> list[float]:
    """Seconds between consecutive sends (mean 1/rate); all zero at rate inf."""
    if math.isinf(rate):
        return [0.0] * num
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num).tolist()


def new_session(connections: int) -> aiohttp.ClientSession:
    """One connection per in-flight request, no total timeout (a long generation is not an error)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(1, connections), force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
    )


async def run_point(
    spec: RequestSpec,
    requests: list[BenchRequest],
    point: LoadPoint,
    seed: int,
    max_seconds: float | None = None,
    on_done=None,
    burstiness: float = 1.0,
) -> tuple[list[RequestResult], float]:
    """Send `requests` under `point`'s load.
    Returns (results of the requests sent, seconds from the first send to the end)."""
    results: list[RequestResult] = []

    def start(req: BenchRequest) -> RequestResult:
        res = RequestResult(req.prompt_len, req.output_len)
        results.append(res)
        return res

    async def finish(session, req):
        res = await send(session, spec, req, start(req))
        if on_done is not None:
            on_done(res)

    async def closed_loop(session):
        queue = list(reversed(requests))

        async def client():
            while queue:
                await finish(session, queue.pop())

        await asyncio.gather(*(client() for _ in range(int(point.value))))

    async def open_loop(session):
        gaps = arrival_gaps(np.random.default_rng(seed), point.value, burstiness, len(requests))
        due = time.perf_counter()  # sends are due at the sums of the gaps: late wake-ups do not drift
        tasks = []
        try:
            for req, gap in zip(requests, gaps):
                tasks.append(asyncio.create_task(finish(session, req)))
                due += gap
                if gap:
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # the time budget ran out between arrivals
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    connections = int(point.value) if point.kind == "concurrency" else len(requests)
    async with new_session(connections) as session:
        t0 = time.perf_counter()
        body = closed_loop(session) if point.kind == "concurrency" else open_loop(session)
        try:
            await asyncio.wait_for(body, timeout=max_seconds)
        except asyncio.TimeoutError:
            pass  # in-flight requests were cancelled and marked cut by send()
        duration = time.perf_counter() - t0
    return results, duration


async def warm_up(spec: RequestSpec, requests: list[BenchRequest], concurrency: int) -> list[RequestResult]:
    """Requests that are not counted: they compile kernels, capture graphs and fill allocator caches."""
    if not requests:
        return []
    results, _ = await run_point(spec, requests, LoadPoint("concurrency", concurrency), seed=0)
    return results
