"""The prompts of a sweep: which tokenizer sizes them, and each (seed, count) built once.

The tokenizer is the one the servers use: --tokenizer, else the launched server's --model
(the embedded model when there is none), else the model path a running attnserve server
reports in /server_info. Every configuration of a sweep gets the very same prompts.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from attnserve.bench.serve.datasets import (
    BenchRequest,
    TokenSampler,
    jsonl_requests,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
    sharegpt_synthetic_requests,
)
from attnserve.bench.serve.launch import get_json
from attnserve.bench.serve.plan import ServerConfig


def flag_value(flags: str, *names: str) -> str | None:
    args = shlex.split(flags)
    for i, a in enumerate(args):
        key, _, val = a.partition("=")
        if key in names:
            return val if val else (args[i + 1] if i + 1 < len(args) else None)
    return None


def tokenizer_path(args, configs: list[ServerConfig]) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    launched = [c for c in configs if c.flags is not None]
    if launched:
        return flag_value(launched[0].flags, "--model", "--model-path")  # None: the embedded model
    info = get_json(configs[0].url + "/server_info", args.api_key) or {}
    if "model_path" in info and info["model_path"] is None:  # attnserve serve on its embedded model
        return None
    for model in (info.get("model_path"), info.get("model")):
        if isinstance(model, str) and Path(model).exists():
            return model
    raise ValueError(
        f"--url {configs[0].url}: cannot tell which tokenizer sizes the prompts; pass --tokenizer "
        "PATH (the server's model directory or .gguf)"
    )


class Requests:
    """The prompts of each (seed, count), built once and shared by every configuration."""

    def __init__(self, args, tokenizer_path: str | None):
        self.args = args
        self.sampler = None
        self.tokenizer = None
        self.cache: dict = {}
        if args.dataset == "jsonl":
            if args.dataset_path is None:
                raise ValueError("--dataset jsonl needs --dataset-path FILE")
            if tokenizer_path is not None or args.tokenizer:
                self.tokenizer = load_tokenizer(tokenizer_path)
        else:
            for name in ("input_len", "output_len", "sp_groups", "sp_system_len", "sp_question_len"):
                if getattr(args, name) < 1:
                    raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
            if not 0.0 <= args.range_ratio < 1.0:
                raise ValueError(f"--random-range-ratio {args.range_ratio}: must be in [0, 1)")
            self.sampler = TokenSampler(load_tokenizer(tokenizer_path))

    def get(self, seed: int, num: int) -> list[BenchRequest]:
        key = (seed, num)
        if key not in self.cache:
            a = self.args
            if a.dataset == "random":
                self.cache[key] = random_requests(
                    self.sampler, num, a.input_len, a.output_len, a.range_ratio, seed
                )
            elif a.dataset == "sharegpt-synthetic":
                self.cache[key] = sharegpt_synthetic_requests(self.sampler, num, seed)
            elif a.dataset == "generated-shared-prefix":
                self.cache[key] = shared_prefix_requests(
                    self.sampler, num, a.sp_groups, a.sp_system_len, a.sp_question_len, a.output_len, seed
                )
            else:
                reqs = jsonl_requests(a.dataset_path, None, self.tokenizer)
                self.cache[key] = [reqs[(seed + i) % len(reqs)] for i in range(num)]
        return self.cache[key]
