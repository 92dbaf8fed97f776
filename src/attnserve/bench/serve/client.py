"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Works against any server that streams `/v1/completions` (or `/v1/chat/completions`)
as SSE `data:` lines ending with `data: [DONE]`; a stream that ends cleanly after a
chunk with a `finish_reason` counts as complete too (`transformers serve` omits
`[DONE]`). Every way a request can go wrong
(an HTTP error status, an error object in the stream, a stream that stops before
`[DONE]`, a dropped connection) ends as a failed result with its reason, so the
sweep counts it instead of crashing. A request still running when the point's time
budget ends is marked `cut` and keeps the tokens it had streamed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from attnserve.bench.serve.datasets import BenchRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    prompt_len: int  # server's usage.prompt_tokens when reported, else the dataset's count
    output_len_asked: int
    start: float = 0.0  # time.perf_counter() when sent
    ttft_s: float | None = None  # first chunk with text
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk with text
    output_tokens: int = 0  # usage.completion_tokens when reported, else chunks with text
    usage_reported: bool = False
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt served by a prefix cache
    error: str | None = None
    cut: bool = False  # stopped by the point's time budget (not a server failure)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cut

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (tokens - 1): the mean time per output token after the first."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RequestSpec:
    """What every request of a run shares."""

    base_url: str
    model: str | None
    endpoint: str = "completions"
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None

    def body(self, req: BenchRequest) -> dict:
        body: dict = {
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            body["model"] = self.model
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def _error_message(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error") or json.loads(raw).get("detail")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = raw.decode("utf-8", "replace")
    return f"HTTP {status}: {str(msg).strip()[:200]}"


def _finished(chunk: dict) -> bool:
    return any(choice.get("finish_reason") for choice in chunk.get("choices") or [])


async def _consume(resp: aiohttp.ClientResponse, res: RequestResult) -> None:
    done = False  # [DONE] seen, or (for servers that omit it) a finish_reason and then a clean end of body
    buf = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if chunk.get("error"):
                err = chunk["error"]
                res.error = f"error in stream: {err.get('message', err) if isinstance(err, dict) else err}"
                return
            done = done or _finished(chunk)
            if _chunk_text(chunk):
                if res.ttft_s is None:
                    res.ttft_s = now - res.start
                res.chunk_times.append(now)
            usage = chunk.get("usage")
            if usage:
                res.usage_reported = True
                res.output_tokens = int(usage.get("completion_tokens") or 0)
                res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
                details = usage.get("prompt_tokens_details") or {}
                res.cached_tokens = int(details.get("cached_tokens") or usage.get("cached_tokens") or 0)
    if not done:
        res.error = "stream ended before data: [DONE] (and without a finish_reason)"
    elif not res.usage_reported:
        res.output_tokens = len(res.chunk_times)


async def send(
    session: aiohttp.ClientSession, spec: RequestSpec, req: BenchRequest, res: RequestResult | None = None
) -> RequestResult:
    """Stream one request; fill `res` as it goes (so a cancelled request keeps what it streamed)."""
    res = res or RequestResult(req.prompt_len, req.output_len)
    res.start = time.perf_counter()
    try:
        async with session.post(
            spec.base_url + ENDPOINTS[spec.endpoint], json=spec.body(req), headers=spec.headers()
        ) as resp:
            if resp.status != 200:
                res.error = _error_message(resp.status, await resp.read())
            else:
                await _consume(resp, res)
    except asyncio.CancelledError:
        res.cut = True
        if not res.usage_reported:
            res.output_tokens = len(res.chunk_times)
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}".strip()[:200]
    finally:
        res.e2e_s = time.perf_counter() - res.start
    return res
