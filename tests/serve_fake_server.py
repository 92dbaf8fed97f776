"""A tiny OpenAI-style streaming server for the bench-serve tests, with faults on purpose.

It streams one chunk (one word) per token with chunked transfer encoding, `token_delay_s`
apart. A client that is not scheduled within that spacing reads two chunks in one read and
times them together (an inter-token latency of 0): 1 ms is below the scheduling jitter of a
loaded host, so a test that measures inter-token latency spaces tokens well above it. By request
order (1-based n): every `fail_every`-th request gets HTTP 500, every `drop_every`-th
has its connection cut mid-stream, every `error_every`-th streams an error object.
The first `cold_requests` answer with one token only, as a first use that differs from
the rest (what a warm-up must absorb). It records the bodies it received so tests can check what the client sent.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # dozens of clients connect at once
    daemon_threads = True


class FakeServer:
    def __init__(
        self,
        fail_every: int = 0,
        drop_every: int = 0,
        error_every: int = 0,
        token_delay_s: float = 0.001,
        usage: bool = True,
        done_marker: bool = True,
        finish_reason: bool = True,
        cold_requests: int = 0,
    ):
        self.fail_every, self.drop_every, self.error_every = fail_every, drop_every, error_every
        self.token_delay_s = token_delay_s
        self.usage = usage
        self.done_marker, self.finish_reason = done_marker, finish_reason
        self.cold_requests = cold_requests
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = _Server(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # one TCP segment per chunk, as real servers stream

            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):  # the client went away (time budget)
                    pass

            def log_message(self, *args):  # keep test output clean
                pass

            def _json(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _chunk(self, text: str) -> None:
                data = text.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def do_GET(self):
                if self.path == "/health":
                    self._json(200, {})
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                elif self.path == "/server_info":
                    self._json(
                        200,
                        {
                            "model": "fake-model",
                            "attention_backend": {"prefill": "fake", "decode": "fake"},
                            "versions": {"fake": "1"},
                        },
                    )
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                    n = len(server.bodies)
                if server.fail_every and n % server.fail_every == 0:
                    self._json(500, {"error": {"message": f"injected failure {n}", "type": "server_error"}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                tokens = 1 if n <= server.cold_requests else body["max_tokens"]
                for i in range(tokens):
                    if server.drop_every and n % server.drop_every == 0 and i == tokens // 2:
                        self.wfile.flush()
                        self.connection.shutdown(2)  # cut mid-stream: no terminating chunk, no [DONE]
                        self.close_connection = True
                        return
                    if server.error_every and n % server.error_every == 0 and i == 1:
                        self._chunk('data: {"error": {"message": "injected engine error"}}\n\n')
                        break
                    time.sleep(server.token_delay_s)
                    self._chunk("data: " + json.dumps({"choices": [{"index": 0, "text": f" w{i}"}]}) + "\n\n")
                if server.finish_reason:
                    self._chunk(
                        "data: "
                        + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
                        + "\n\n"
                    )
                prompt_tokens = len(str(body.get("prompt", "")).split())
                if server.usage:
                    usage = {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": tokens,
                        "total_tokens": prompt_tokens + tokens,
                    }
                    self._chunk("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n")
                if server.done_marker:
                    self._chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        return Handler
