"""Start `attnserve serve` on a free loopback port for the length of a sweep, then stop it.

The server runs as a child process with its log in a file; the launcher waits for
`/health` to answer 200, and if the process dies first (a bad flag, an unknown
backend, out of memory) the error carries the end of that log rather than a bare
timeout. On exit it sends SIGTERM (the server's graceful shutdown) and kills the
process group only if that does not end it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

RESERVED_FLAGS = ("--host", "--port")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def get_json(url: str, api_key: str | None = None) -> dict | None:
    """GET a JSON endpoint (/server_info, /v1/models); None when the server does not have it."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def split_flags(flags: str) -> list[str]:
    """Serve flags as one shell-quoted string; --host/--port are the launcher's to choose."""
    args = shlex.split(flags)
    for a in args:
        if a.split("=", 1)[0] in RESERVED_FLAGS:
            raise ValueError(
                f"launch flags {flags!r}: {a.split('=', 1)[0]} is chosen by the launcher "
                "(a free loopback port); leave it out, or run the server yourself and pass --url"
            )
    return args


class LaunchedServer:
    def __init__(self, flags: str, log_path: Path, timeout_s: float = 600.0, host: str = "127.0.0.1"):
        self.args = split_flags(flags)
        self.log_path = Path(log_path)
        self.timeout_s = timeout_s
        self.host = host
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "attnserve",
            "serve",
            *self.args,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> LaunchedServer:
        self.port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(
                    f"`{shlex.join(self.command)}` exited with code {rc} before /health answered; "
                    f"end of its log ({self.log_path}):\n{self.log_tail()}"
                )
            if http_status(self.url + "/health") == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(
            f"`{shlex.join(self.command)}`: /health did not answer 200 within {self.timeout_s:.0f} s; "
            f"end of its log ({self.log_path}):\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
