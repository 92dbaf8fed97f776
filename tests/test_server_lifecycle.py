"""The server's start and end: refusing a backend that cannot run, a failing or killed engine process, a killed
HTTP process, SIGTERM mid-stream; no process is ever left behind."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from server_helpers import (
    fail_steps_once_file_exists,
    process_running,
    running_server,
    serve_process,
    serving_line,
)

from attnserve.engine.config import EngineConfig
from attnserve.server.engine_process import EXIT_GRACE_S


def test_unknown_backend_is_refused_before_the_port_is_bound():
    proc = serve_process("--attention-backend", "no_such_backend")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert "no_such_backend" in err and "serving on" not in err


@pytest.mark.needs_embedded_model
def test_a_failing_engine_turns_health_to_503_and_open_requests_to_500(tmp_path):
    flag = tmp_path / "break"
    config = EngineConfig(device="cpu", max_total_tokens=1024, attention_backend="torch_native")
    with running_server(config, setup=functools.partial(fail_steps_once_file_exists, flag)) as (url, state):
        ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        flag.touch()
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]
        again = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=60)
        assert again.status_code == 503  # refused at once, never hung
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'attnserve:requests_total{finish_reason="error"} 1.0' in metrics  # the failed one is counted
        deadline = time.monotonic() + EXIT_GRACE_S + 30
        while state.engine.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the server's event loop reaps the process (a join here would race with it)
        assert state.engine.exitcode == 1  # a failed engine process exits


@pytest.mark.needs_embedded_model
def test_a_killed_engine_process_ends_open_requests_and_turns_health_to_503():
    config = EngineConfig(device="cpu", max_total_tokens=2048, attention_backend="torch_native")
    with running_server(config) as (url, state):
        long = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(
            httpx.post(url + "/v1/completions", json=long, timeout=120)))
        waiter.start()
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        _waitprocess_running(url, 2)  # the plain request is generating too
                        os.kill(state.engine.pid, signal.SIGKILL)  # mid-stream
        waiter.join(60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "SIGKILL" in error["message"]
        assert plain[0].status_code == 500 and "SIGKILL" in plain[0].json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json=long, timeout=60).status_code == 503
        assert httpx.get(url + "/server_info", timeout=10).status_code == 200  # the last state read
    assert not process_running(state.engine.pid)


@pytest.mark.needs_embedded_model
def test_sigterm_during_a_stream_exits_cleanly():
    proc = serve_process("--max-total-tokens", "2048", "--graceful-shutdown-timeout", "120")  # room for a busy machine
    lines: list[str] = []
    try:
        port = _port(proc, lines)
        engine_pid = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()["processes"]["engine"]
        body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
        assert events[-1] == "[DONE]"
        finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if e.startswith("{")]
        assert finishes[-1] == "length"  # the open stream was allowed to finish
        assert proc.wait(timeout=60) == 0
        assert not process_running(engine_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.needs_embedded_model
def test_sigterm_past_the_graceful_timeout_ends_open_streams_with_an_error_and_done():
    proc = serve_process("--max-total-tokens", "4096", "--graceful-shutdown-timeout", "1")
    lines: list[str] = []
    try:
        port = _port(proc, lines)
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)  # far from the end of the stream
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert proc.wait(timeout=60) == 0
        log = "".join(lines) + proc.stderr.read()
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.needs_embedded_model
def test_a_killed_http_process_takes_the_engine_process_with_it():
    proc = serve_process("--max-total-tokens", "2048")
    try:
        port = _port(proc, [])
        engine_pid = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()["processes"]["engine"]
        assert process_running(engine_pid)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while process_running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_running(engine_pid), "the engine process outlived its HTTP process"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _waitprocess_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(url + "/server_info", timeout=10).json()["running"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests running"
        time.sleep(0.05)


def _port(proc: subprocess.Popen, lines: list[str]) -> int:
    return int(serving_line(proc, lines).group(1))
