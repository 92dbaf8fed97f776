"""Soak check of `attnserve serve`: mixed traffic with disconnects and bad input, then nothing may be left over.

Launches the server (HTTP and engine processes, or a supervisor over API workers
and the engine with --api-workers in --server-flags), sends --requests requests
from --clients threads: plain and streamed completions and chats, n > 1, stop
strings, streams the client leaves mid-way, and bad bodies that must get a 4xx.
Then /server_info must show pages_in_use 0 and nothing running, SIGTERM must end
the server with exit code 0, and every process it started must be gone.

    python benchmarks/serve_soak.py --out benchmarks/results/serve-soak-cpu.json
    python benchmarks/serve_soak.py --server-flags "--device cpu --max-total-tokens 4096 --api-workers 2" \
        --out benchmarks/results/serve-soak-cpu-api-workers.json
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx

from attnserve.bench.serve.launch import LaunchedServer


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its reaper counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


BAD = [b"{not json", b'{"max_tokens": 4}', b'{"prompt": "hi", "max_tokens": 0}', b'{"prompt": [1000000000]}',
       b'{"prompt": "hi", "temperature": -1}', b'{"prompt": "abc \\ud800"}', b'{"prompt": "hi", "n": 0}']


def one_request(url: str, i: int, rng: random.Random) -> str:
    """Sends request i; returns its outcome ("ok", "left", "4xx") or raises on anything unexpected."""
    kind = rng.choice(["plain", "stream", "leave", "chat", "n", "stop", "bad"])
    prompt = rng.choice(["The capital of France is", "1, 2, 3,", "def fibonacci(n):", "Once upon a time"])
    body = {"prompt": prompt, "max_tokens": rng.randrange(2, 24), "temperature": rng.choice([0, 0.8])}
    if kind == "bad":
        r = httpx.post(url + "/v1/completions", content=rng.choice(BAD), headers={"content-type": "application/json"},
                       timeout=300)
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (r.status_code, r.text)
        return "4xx"
    if kind == "chat":
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": body["max_tokens"]})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], r.text
        return "ok"
    if kind in ("stream", "leave"):
        leave_after = rng.randrange(1, 4) if kind == "leave" else None
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "max_tokens": 64,
                                                                  "ignore_eos": True}, timeout=300) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert '"error"' not in line, line
                    events += 1
                    if leave_after is not None and events >= leave_after:
                        return "left"
        return "ok"
    if kind == "n":
        body["n"] = 3
    if kind == "stop":
        body["stop"] = [" ", "\n"]
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200 and len(r.json()["choices"]) == body.get("n", 1), r.text
    return "ok"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-flags", default="--device cpu --max-total-tokens 4096")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rng = random.Random(7)
    seeds = [rng.randrange(2**32) for _ in range(args.requests)]
    outcomes: Counter = Counter()
    failures: list[str] = []
    lock = threading.Lock()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        server = LaunchedServer(args.server_flags, Path(tmp) / "server.log", timeout_s=600)
        with server:
            url = server.url
            engine_pid = httpx.get(url + "/server_info", timeout=30).json()["processes"]["engine"]

            def run(i: int) -> None:
                try:
                    outcome = one_request(url, i, random.Random(seeds[i]))
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    outcome = "unexpected"
                    with lock:
                        failures.append(f"request {i}: {exc!r}")
                with lock:
                    outcomes[outcome] += 1

            with ThreadPoolExecutor(args.clients) as pool:
                list(pool.map(run, range(args.requests)))
            info = {}
            for _ in range(100):  # the aborts of the last disconnects land within an engine step
                info = httpx.get(url + "/server_info", timeout=30).json()
                if info["kv_cache"]["pages_in_use"] == 0 and info["running"] == 0:
                    break
                time.sleep(0.1)
            health = httpx.get(url + "/health", timeout=30).status_code
            started = descendants(server.proc.pid)  # the engine, and the API workers if any
            server.proc.send_signal(signal.SIGTERM)
            exit_code = server.proc.wait(120)
        engine_left = running(engine_pid)
        left = [pid for pid in started if running(pid)]
        log_tail = server.log_tail(5)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "server_flags": args.server_flags, "requests": args.requests, "clients": args.clients,
              "seconds": round(time.monotonic() - start, 1), "outcomes": dict(outcomes), "failures": failures,
              "health_after": health, "pages_in_use_after": info["kv_cache"]["pages_in_use"],
              "running_after": info["running"], "sigterm_exit_code": exit_code,
              "engine_process_left": engine_left, "processes_started": len(started), "processes_left": left,
              "server_log_tail": log_tail}
    report["passed"] = (not failures and health == 200 and report["pages_in_use_after"] == 0
                        and report["running_after"] == 0 and exit_code == 0 and not engine_left and not left)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
