"""An attnserve server on 127.0.0.1 and a free port: HTTP in a thread of this process, the engine in the engine
process it spawns (one model load serves many tests)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn

from attnserve.server.app import ServerSettings, ServerState, create_app
from attnserve.server.engine_client import EngineClient
from attnserve.server.engine_owner import EngineProcess
from attnserve.server.uvicorn_server import UvicornServer


@contextlib.contextmanager
def running_server(config, setup=None, **settings):
    """Yields (base_url, state) for a server over an engine process built from `config` (an EngineConfig);
    `setup(engine)` runs in the engine process once its engine is built. Stops both afterwards."""
    engine = EngineProcess.start(config, setup)
    try:
        state = ServerState(EngineClient.of(engine), ServerSettings(**{"served_model_name": "test-model", **settings}))
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning",
                                timeout_graceful_shutdown=5)
        server = UvicornServer(config)
        thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: no signal handlers
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}", state
        finally:
            server.should_exit = True
            thread.join(30)
            assert not thread.is_alive(), "the test server did not stop"
    finally:
        engine.release()
    assert not engine.process.is_alive()


def fail_steps_once_file_exists(flag: Path, engine) -> None:
    """Engine-process setup: every forward pass raises "device lost" once `flag` exists (a test creates it)."""
    real_forward = engine.runner.forward

    def forward(batch):
        if flag.exists():
            raise RuntimeError("device lost")
        return real_forward(batch)

    engine.runner.forward = forward


def serve_process(*flags: str) -> subprocess.Popen:
    """`attnserve serve` on the CPU and a free port, as a user starts it; its stderr is a text pipe."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "attnserve", "serve", "--port", "0", "--device", "cpu", *flags],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)


def serving_line(proc: subprocess.Popen, lines: list[str], timeout: float = 300) -> re.Match:
    """The match of the "serving on" line in `proc`'s stderr (lines read so far go to `lines`); a server that
    has not said it within `timeout` seconds is killed and the test fails with its log."""
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if m:
                return m
    finally:
        killer.cancel()
    raise AssertionError("".join(lines))


def process_running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for its reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


STUB_TOKEN = 1000  # an ordinary word piece of the embedded tokenizer: every stub step samples it


def stub_steps_at_gpu_rates(engine) -> None:
    """Engine-process setup: every forward pass returns at once with logits that pick STUB_TOKEN, so the
    server's plumbing (sockets, streams, metrics) carries tokens as fast as a GPU makes them, whatever this
    machine's speed. The scheduler, pages and sampler still run for real."""
    import torch

    vocab = engine.vocab_size

    def forward(batch):
        logits = torch.zeros(sum(batch.sample), vocab)  # [sampling requests, vocab]
        logits[:, STUB_TOKEN] = 1.0
        return logits

    engine.runner.forward = forward
