"""`attnserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

Two processes, as SGLang runs them: this one serves HTTP, tokenizes and
detokenizes; the engine process it spawns runs the scheduler and the model
(server/engine_process.py). With --api-workers N, this process supervises N
HTTP processes sharing the port instead (server/api_workers.py). The engine is built before the port is bound, so a
model or backend that cannot run is refused with its reason and a non-zero
exit, never a server that answers with errors. SIGINT/SIGTERM stop accepting,
let open streams finish (up to --graceful-shutdown-timeout, then abort them),
stop the engine process and exit 0. Neither process outlives the other: the
engine process exits when this one is gone (even killed), and this one turns
/health to 503 and ends open requests with an error when the engine process dies.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import uvicorn

from attnserve.commands.engine_args import add_engine_arguments, engine_config, run_other_node
from attnserve.server.api_workers import serve_with_workers
from attnserve.server.app import ServerSettings, ServerState, create_app
from attnserve.server.engine_client import EngineClient
from attnserve.server.engine_owner import EngineProcess
from attnserve.server.protocol import MAX_TOKENS_HELP
from attnserve.server.uvicorn_server import UvicornServer


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and /server_info. "
        "Without --model it serves the embedded SmolLM2-135M-Instruct. " + MAX_TOKENS_HELP,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000; 0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1/ route")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: from the model path)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="more completions than this waiting for the engine are refused with 503 (default: no limit; "
                   "with --api-workers, each worker admits its share)")
    p.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body accepted, in bytes (default: 8 MiB; larger ones get 413)")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=10.0,
                   help="seconds open streams may take to finish after SIGINT/SIGTERM (default: 10)")
    p.add_argument("--log-requests", action="store_true", help="log every HTTP request (uvicorn's access log)")
    p.add_argument("--api-workers", "--api-server-count", dest="api_workers", type=int, default=1,
                   help="HTTP processes (tokenizing, serving, detokenizing) over the one engine process; more "
                   "than 1 shares the port among them under a supervisor (vLLM's --api-server-count; default: 1)")
    add_engine_arguments(p)
    return p


def served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    return Path(model).name.removesuffix(".gguf") or model


def run(args) -> int:
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests {args.max_queued_requests}: give a number >= 0")
    if args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes}: give at least 1024")
    if args.api_workers < 1:
        raise ValueError(f"--api-workers {args.api_workers}: give at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.node_rank != 0:
        return run_other_node(args)  # node 0 serves; this machine only runs ranks
    # the engine process refuses a model or backend that cannot run, before the port is bound
    engine = EngineProcess.start(engine_config(args))
    try:
        settings = ServerSettings(served_model_name=args.served_model_name or served_name(args.model),
                                  api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                                  max_request_bytes=args.max_request_bytes, api_workers=args.api_workers)
        options = {"log_level": "warning", "access_log": args.log_requests,
                   "timeout_graceful_shutdown": args.graceful_shutdown_timeout}
        if args.api_workers > 1:
            return serve_with_workers(engine, settings, options, args.api_workers, args.host, args.port)
        app = create_app(ServerState(EngineClient.of(engine), settings))
        config = uvicorn.Config(app, host=args.host, port=args.port, **options)
        UvicornServer(config).run()  # a port it cannot bind exits 1 with uvicorn's message
    finally:
        engine.release()
    return 0
