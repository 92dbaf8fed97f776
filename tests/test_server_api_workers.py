"""`serve --api-workers 2`: two HTTP processes over one engine process, under a supervisor. Their metrics add
up, a killed worker's requests free their pages and a new worker replaces it, a dead engine turns every worker's
/health to 503, SIGTERM ends every process with status 0, and a killed supervisor leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest
from server_helpers import process_running, serve_process, serving_line

LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}


def _start(*flags: str) -> tuple:
    """(process, base url, [worker pids], stderr lines) of a server with two API workers."""
    proc = serve_process("--api-workers", "2", "--max-total-tokens", "32768", *flags)
    lines: list[str] = []
    line = serving_line(proc, lines).string
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # keep the pipe drained
    m = re.search(r"127\.0\.0\.1:(\d+) .* \(pids (\d+), (\d+)\)", line)
    assert m, line
    return proc, f"http://127.0.0.1:{m.group(1)}", [int(m.group(2)), int(m.group(3))], lines


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _until(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _info(url: str) -> dict:
    """/server_info, or {} while no worker answers in time (a new one may still be starting)."""
    try:
        return httpx.get(url + "/server_info", timeout=10).json()
    except httpx.HTTPError:
        return {}


@pytest.mark.needs_embedded_model
def test_api_workers_add_up_their_metrics_and_report_a_dead_engine_then_exit_cleanly():
    proc, url, workers, lines = _start()
    try:
        info = _info(url)
        assert info["processes"]["api_workers"] == 2 and info["processes"]["http"] in workers
        engine_pid = info["processes"]["engine"]
        body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        results: list[dict] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(url + "/v1/completions", json=body, timeout=120).json())) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({r["choices"][0]["text"] for r in results}) == 1  # greedy: one answer, whichever worker served
        for _ in range(4):  # whichever worker answers the scrape counts every worker's requests
            metrics = httpx.get(url + "/metrics", timeout=10).text
            assert 'attnserve:requests_total{finish_reason="length"} 8.0' in metrics, metrics
            assert "attnserve:generation_tokens_total 48.0" in metrics
            assert len(re.findall(r"^attnserve:num_requests_running ", metrics, re.MULTILINE)) == 1  # one engine, once

        os.kill(engine_pid, signal.SIGKILL)
        seen: list[httpx.Response] = []
        _until(lambda: seen.append(httpx.get(url + "/health", timeout=10)) or (
            len(seen) >= 4 and all(r.status_code == 503 for r in seen[-4:])), "a worker's health stayed 200")
        for health in seen[-4:]:  # whichever worker answers has heard it from the supervisor, with the cause
            assert "killed by SIGKILL" in health.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not any(process_running(pid) for pid in [*workers, engine_pid])
        assert "Traceback" not in "".join(lines), "".join(lines)
    finally:
        _stop(proc)


@pytest.mark.needs_embedded_model
def test_a_killed_api_worker_frees_its_requests_pages_and_is_replaced():
    proc, url, workers, lines = _start()
    streams, broken, stop = 6, [], threading.Event()

    def stream():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=120) as r:
                for line in r.iter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            broken.append(1)  # its worker died under it

    try:
        threads = [threading.Thread(target=stream) for _ in range(streams)]
        for t in threads:
            t.start()
        _until(lambda: _info(url).get("running") == streams, "the streams did not all start")
        killed = 0
        for victim in workers:  # the first kill may find all streams on the other worker
            os.kill(victim, signal.SIGKILL)
            killed += 1
            _until(lambda v=victim: not process_running(v), "the worker outlived SIGKILL")
            time.sleep(2)  # let the broken streams notice
            if broken:
                break
        assert broken
        _until(lambda: _info(url).get("running") == streams - len(broken),
               "the dead worker's requests still run in the engine")
        _until(lambda: "".join(lines).count(") is ready") >= killed, "no new worker took the dead one's place",
               timeout=120)
        stop.set()
        for t in threads:
            t.join(60)
        _until(lambda: _info(url).get("kv_cache", {}).get("pages_in_use") == 0, "pages stayed in use")
        assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
    finally:
        stop.set()
        _stop(proc)


@pytest.mark.needs_embedded_model
def test_a_killed_supervisor_leaves_no_process():
    proc, url, workers, _ = _start()
    try:
        engine_pid = _info(url)["processes"]["engine"]
        proc.kill()
        proc.wait()
        _until(lambda: not any(process_running(pid) for pid in [*workers, engine_pid]),
               "an API worker or the engine outlived the supervisor", timeout=60)
    finally:
        _stop(proc)


def test_api_workers_below_one_are_refused():
    proc = serve_process("--api-workers", "0")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "--api-workers 0" in err
