"""The command line of `attnserve bench serve`: servers, dataset, load and output flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnserve.bench.serve.client import ENDPOINTS
from attnserve.bench.serve.datasets import DATASETS


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("servers")
    g.add_argument(
        "--url",
        action="append",
        metavar="[LABEL=]URL",
        help="a running OpenAI-compatible server, e.g. http://127.0.0.1:30000 (repeatable)",
    )
    g.add_argument(
        "--launch",
        metavar="FLAGS",
        default=None,
        help='start `attnserve serve FLAGS` on a free loopback port for the sweep, e.g. "--model DIR" '
        "(a single flag with no space needs the = form: --launch=--disable-cuda-graph)",
    )
    g.add_argument(
        "--backends",
        metavar="A,B",
        help="launch one server per attention backend "
        "(--launch flags + --attention-backend NAME), e.g. triton,flashinfer",
    )
    g.add_argument(
        "--compare",
        nargs="+",
        metavar="[LABEL=]FLAGS",
        help='launch one server per flag set on top of --launch, e.g. "--attention-backend triton" '
        '"fi=--decode-attention-backend flashinfer"',
    )
    g.add_argument(
        "--launch-timeout", type=float, default=900.0, help="seconds to wait for /health (default 900)"
    )
    g.add_argument(
        "--server-log-dir", type=Path, default=None, help="where launched servers log (default: a temp dir)"
    )
    g.add_argument(
        "--model-name",
        default=None,
        help='the request\'s "model" field (default: the first id of GET /v1/models)',
    )
    g.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINTS),
        default="completions",
        help="completions (prompt text) or chat (the prompt as one user message)",
    )
    g.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-len tokens (default on; off for servers that refuse the field)",
    )
    g.add_argument("--extra-body", default=None, metavar="JSON", help="fields merged into every request body")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument("--dataset-path", type=Path, help="the JSONL file for --dataset jsonl")
    d.add_argument(
        "--tokenizer",
        default=None,
        help="HF model directory or .gguf whose tokenizer sizes the "
        "prompts (default: the launched --model, or the embedded model)",
    )
    d.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens (default 1024)")
    d.add_argument("--output-len", type=int, default=128, help="random/shared-prefix: tokens to generate")
    d.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len * (1 - r), len] (default 0: all equal)",
    )
    d.add_argument("--sp-groups", type=int, default=4, help="shared-prefix: number of system prompts")
    d.add_argument("--sp-system-len", type=int, default=512, help="shared-prefix: tokens per system prompt")
    d.add_argument("--sp-question-len", type=int, default=64, help="shared-prefix: tokens per question")
    ld = p.add_argument_group("load")
    ld.add_argument(
        "--concurrency",
        default=None,
        metavar="N[,N...]",
        help="closed loop: clients each sending the next request when the last ends (default 1,8,32,64 "
        "unless --request-rate is given)",
    )
    ld.add_argument(
        "--request-rate",
        default=None,
        metavar="R[,R...]",
        help="open loop: Poisson arrivals per second (inf: all at once)",
    )
    ld.add_argument(
        "--num-prompts",
        default="64",
        help="requests per point and seed: a count, or Nx = N per client / N seconds of arrivals "
        "(or one value per point, e.g. 2x,1x,1x,1x)",
    )
    ld.add_argument(
        "--seeds", default="1", help="repeats of every point (or one count per point, e.g. 3,3,1,1)"
    )
    ld.add_argument("--seed", type=int, default=0, help="first seed (prompts and arrival times)")
    ld.add_argument("--warmup-requests", type=int, default=2, help="uncounted requests per configuration")
    ld.add_argument(
        "--max-point-seconds",
        type=float,
        default=None,
        help="time budget of one point and seed: requests still running are cut (counted apart)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--json", type=Path, default=Path("serve-bench.json"), help="results (Markdown and PNG beside it)"
    )
    o.add_argument("--title", default=None, help="heading of the report")
    o.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
