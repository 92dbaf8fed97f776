"""Tensor parallelism with the real model and real processes, on one server (one model load per tp size):
`attnserve serve --tp-size 3` over SmolLM2 (9 query / 3 KV heads, one KV head per rank) answers an OpenAI
client with tp 1's greedy tokens and logprobs; then a rank killed mid-run stops the server within
seconds, naming the rank, with no process left behind."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def server_tp3():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "attnserve", "serve", "--port", "0", "--device", "cpu",
                             "--tp-size", "3", "--max-total-tokens", "256", "--attention-backend", "torch_native",
                             "--dtype", "fp32"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    try:
        port, pids = None, {}
        for line in proc.stderr:
            lines.append(line)
            if m := re.search(r"worker pids (\{.*\})", line):
                pids = {int(r): int(p) for r, p in re.findall(r"(\d+): (\d+)", m.group(1))}  # {rank: pid}
            if m := re.search(r"serving on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port is not None and sorted(pids) == [1, 2], "".join(lines)
        yield proc, port, pids, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.needs_embedded_model
def test_serve_tp3_answers_an_openai_client_as_tp1_would(server_tp3):
    from openai import OpenAI

    _, port, _, _ = server_tp3
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    done = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                     temperature=0, logprobs=5)
    assert done.usage.completion_tokens == NEW_TOKENS
    got = done.choices[0].logprobs

    llm = LLM(device="cpu", dtype="fp32", max_total_tokens=256, attention_backend="torch_native")  # tp 1, here
    ref = llm.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, logprobs=5))[0]
    assert done.choices[0].text == ref.text  # greedy continuation identical
    # the first token's top 5 come from the prefill's logits: equal within fp32 tolerance, as later ones
    assert len(ref.logprobs) == len(got.top_logprobs) == NEW_TOKENS
    for lp, top in zip(ref.logprobs, got.top_logprobs):
        assert len(top) == len(lp.top) == 5
        assert all(math.isclose(a, b, abs_tol=1e-4) for (_, a), b in zip(lp.top, sorted(top.values(), reverse=True)))


@pytest.mark.needs_embedded_model
def test_a_killed_rank_turns_health_to_503_naming_it_and_leaves_no_process(server_tp3):
    """The ranks live in the engine process's world: a killed rank ends the engine process, the HTTP process
    reports why on /health until it is stopped, and no rank outlives either."""
    import httpx

    proc, port, pids, lines = server_tp3
    os.kill(pids[2], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        if (health.status_code == 503 and "it has stopped" not in health.text) or time.monotonic() > deadline:
            break  # (until the HTTP side has read why, /health says only that the engine stopped)
        time.sleep(0.2)
    assert health.status_code == 503, health.text
    assert re.search(r"tensor-parallel rank 2 \(pid \d+\) was killed by signal 9", health.text), health.text
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values()), "a rank outlived the engine process"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    err = "".join(lines) + proc.stderr.read()
    assert re.search(r"tensor-parallel rank 2 \(pid \d+\) was killed by signal 9", err), err


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped has already ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_rank_that_raises_is_reported_by_rank(capfd):
    import threading

    import torch
    from tp_helpers import failing_rank

    from attnserve.distributed.groups import destroy_groups, init_groups
    from attnserve.distributed.launch import Topology, Workers, free_local_addr

    failures: list[str] = []
    reported = threading.Event()

    def on_failure(message: str) -> None:  # the server's reaction is to exit; here, to record it
        failures.append(message)
        reported.set()

    addr = free_local_addr()
    workers = Workers(Topology(2), addr, torch.device("cpu"), failing_rank, lambda rank, device: (),
                      on_failure=on_failure)
    init_groups(0, 2, addr, torch.device("cpu"))
    try:
        assert reported.wait(60), "the failing rank was not reported"
    finally:
        destroy_groups()
        workers.close(timeout=0)
    assert re.search(r"tensor-parallel rank 1 \(pid \d+\) exited with code 1", failures[0])
    err = capfd.readouterr().err
    assert "[tp rank 1] ERROR" in err and "rank failed on purpose" in err  # its traceback, prefixed by rank
