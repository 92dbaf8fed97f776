"""The command line of `attnserve bench serve`: servers, dataset, load and output flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnserve.bench.serve.client import ENDPOINTS
from attnserve.bench.serve.datasets import DATASET_ALIASES, DATASETS


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
        '"fi=--decode-attention-backend flashinfer"; spec=NAME launches with --speculative-algorithm NAME',
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
    d.add_argument(
        "--dataset-name",
        "--dataset",
        dest="dataset",
        choices=DATASETS,
        type=lambda name: DATASET_ALIASES.get(name, name),
        default="random",
        help="random (--input-len/--output-len, --random-range-ratio), sharegpt-synthetic (log-normal "
        "lengths around ShareGPT's means, no download), generated-shared-prefix (alias shared-prefix: "
        "system prompts shared by many questions, for prefix-cache hits), jsonl (--dataset-path)",
    )
    d.add_argument("--dataset-path", type=Path, help="the JSONL file for --dataset-name jsonl")
    d.add_argument(
        "--tokenizer",
        default=None,
        help="HF model directory or .gguf whose tokenizer sizes the "
        "prompts (default: the launched --model, or the embedded model)",
    )
    d.add_argument(
        "--input-len", "--random-input-len", type=int, default=1024, help="random: prompt tokens (default 1024)",
    )
    d.add_argument(
        "--output-len",
        "--random-output-len",
        type=int,
        default=128,
        help="random/generated-shared-prefix: tokens to generate",
    )
    d.add_argument(
        "--random-range-ratio",
        "--range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len * (1 - r), len * (1 + r)], as vllm bench serve draws them "
        "(default 0: all equal)",
    )
    d.add_argument(
        "--gsp-num-groups", "--sp-groups", dest="sp_groups", type=int, default=4,
        help="generated-shared-prefix: number of system prompts",
    )
    d.add_argument(
        "--gsp-system-prompt-len", "--sp-system-len", dest="sp_system_len", type=int, default=512,
        help="generated-shared-prefix: tokens per system prompt",
    )
    d.add_argument(
        "--gsp-question-len", "--sp-question-len", dest="sp_question_len", type=int, default=64,
        help="generated-shared-prefix: tokens per question",
    )
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
        "--burstiness",
        type=float,
        default=1.0,
        help="open loop: arrival gaps are gamma-distributed with this shape and mean 1/rate, as in vllm "
        "bench serve (1: Poisson; below 1 burstier, above 1 more even)",
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
    ld.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="requests sent at once to each configuration before the first point, not counted: kernels "
        "compile and caches fill there (default 2; as many as the largest concurrency warms its batch size)",
    )
    ld.add_argument(
        "--max-point-seconds",
        type=float,
        default=None,
        help="time budget of one point and seed: requests still running are cut (counted apart)",
    )
    ld.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        default=None,
        help="service-level objectives, as vllm bench serve: ttft, tpot and/or e2el in milliseconds, e.g. "
        "ttft:500 tpot:20; goodput is the rate of completed requests that meet all of them",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--json", type=Path, default=Path("serve-bench.json"), help="results (Markdown and PNG beside it)"
    )
    o.add_argument("--title", default=None, help="heading of the report")
    o.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
