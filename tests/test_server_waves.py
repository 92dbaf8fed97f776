"""Waves of concurrent streams through the server as users run it, one HTTP process and --api-workers 2, with
the engine's forward pass stubbed so tokens arrive at GPU rates: every wave completes, /server_info answers
throughout, and once drained the metrics read what their names say."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import serving_line

pytestmark = pytest.mark.needs_embedded_model  # the stub serves the embedded model's tokenizer and shapes

WAVES, STREAMS, TOKENS = 3, 64, 48
HANG_S = 120  # a wave or a query that takes this long is stuck (a wave takes seconds)


def _serve(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("stub_serve.py")), "--port", "0",
                             "--device", "cpu", "--disable-radix-cache", "--max-running-requests", str(STREAMS),
                             "--max-total-tokens", "32768", *flags],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    port = serving_line(proc, lines).group(1)
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # keep the pipe drained
    return proc, f"http://127.0.0.1:{port}"


def _stream(url: str, i: int, out: list) -> None:
    body = {"prompt": f"Request {i} of a wave: once upon a time", "max_tokens": TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        out.append(usage["completion_tokens"] if usage else f"no usage (HTTP {r.status_code})")
    except httpx.HTTPError as exc:
        out.append(repr(exc))


def _poll_server_info(url: str, stop: threading.Event, answers: list) -> None:
    while not stop.is_set():
        t = time.monotonic()
        try:
            code = httpx.get(url + "/server_info", timeout=HANG_S).status_code
        except httpx.HTTPError as exc:
            code = repr(exc)
        answers.append((code, time.monotonic() - t))
        stop.wait(0.2)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("flags", [(), ("--api-workers", "2")], ids=["one-process", "api-workers-2"])
def test_waves_of_streams_complete_and_server_info_answers_throughout(flags):
    proc, url = _serve(*flags)
    try:
        for wave in range(WAVES):
            done: list = []
            answers: list = []
            stop = threading.Event()
            poller = threading.Thread(target=_poll_server_info, args=(url, stop, answers))
            poller.start()
            clients = [threading.Thread(target=_stream, args=(url, i, done)) for i in range(STREAMS)]
            for c in clients:
                c.start()
            for c in clients:
                c.join(HANG_S + 10)
            stop.set()
            poller.join(HANG_S + 10)
            assert done == [TOKENS] * STREAMS, f"wave {wave}: {sorted(map(str, done))}"
            assert answers and all(code == 200 for code, _ in answers), f"wave {wave}: {answers}"
            slowest = max(s for _, s in answers)
            assert slowest < 30, f"wave {wave}: /server_info took {slowest:.1f} s"  # the engine answers between steps
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert _metric(metrics, "attnserve:num_requests_running") == 0
        assert _metric(metrics, "attnserve:num_requests_waiting") == 0
        total = WAVES * STREAMS
        assert _metric(metrics, 'attnserve:requests_total{finish_reason="length"}') == total
        assert _metric(metrics, "attnserve:generation_tokens_total") == total * TOKENS
        assert _metric(metrics, "attnserve:engine_finished_total") == total
        assert _metric(metrics, "attnserve:engine_aborted_total") == 0
        assert _metric(metrics, "attnserve:engine_decode_tokens_total") == total * (TOKENS - 1)
        assert _metric(metrics, "attnserve:kv_pages{state=\"in_use\"}") == 0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
