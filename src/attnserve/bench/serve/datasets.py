"""Prompts for `attnserve bench serve`: random tokens, ShareGPT-like lengths, shared system prompts, JSONL.

Prompts are sent as text so that any OpenAI-compatible server can be measured, yet
their lengths must be exact in the server's tokens. Random prompts are therefore
drawn from tokens that survive decode -> encode on their own, and the whole sequence
is re-encoded until text and ids agree; the length recorded is the re-encoded one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnserve.models.gguf_loader import GGUFFile
from attnserve.models.loader import embedded_model_path
from attnserve.models.tokenizer import Tokenizer

DATASETS = ("random", "sharegpt-synthetic", "generated-shared-prefix", "jsonl")
DATASET_ALIASES = {"shared-prefix": "generated-shared-prefix"}

# ShareGPT-like lengths, with no download. The means are those the vLLM paper reports for ShareGPT
# (Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
# SOSP 2023, section 6.1 and Fig. 11: 161.31 input and 337.99 output tokens on average). Lengths are
# drawn log-normal, the usual model of such long-tailed lengths; the log-space spread (sigma 1.0 for
# both, so the median is e^-0.5 = 0.61 of the mean) is chosen to give Fig. 11's long right tail, not
# fitted to the raw conversations. Draws are then kept within the bounds `vllm bench serve` applies
# to ShareGPT (prompt and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048), which pulls
# the means a few percent below the targets.
SHAREGPT_INPUT_MEAN, SHAREGPT_OUTPUT_MEAN, SHAREGPT_SIGMA = 161.31, 337.99, 1.0
SHAREGPT_MIN_LEN, SHAREGPT_MAX_INPUT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` in the tokenizer the run uses (no BOS)
    output_len: int  # max_tokens asked for (exact with ignore_eos)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None):
    """The attnserve Tokenizer of an HF model directory or a .gguf file (None: the embedded model).
    Cached: reading a GGUF file's vocabulary takes seconds, and a process may sweep several times."""
    resolved = embedded_model_path() if path is None else Path(path)
    if resolved.is_dir() and not (resolved / "tokenizer.json").is_file():
        ggufs = sorted(resolved.glob("*.gguf"))
        resolved = ggufs[0] if len(ggufs) == 1 else resolved
    if resolved.is_file() and resolved.suffix == ".gguf":
        fields = GGUFFile(resolved).tokenizer_fields()
        if fields is None:
            raise ValueError(f"{resolved}: the GGUF file has no tokenizer; pass --tokenizer DIR")
        return Tokenizer.from_gguf(fields, str(resolved))
    if resolved.is_dir():
        config_file = resolved / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        tok = Tokenizer.from_hf_dir(resolved, config)
        if tok is not None:
            return tok
    raise FileNotFoundError(
        f"no tokenizer at {resolved}: expected an HF model directory with tokenizer.json "
        "or a .gguf file (pass --tokenizer PATH)"
    )


class TokenSampler:
    """Draws token sequences whose text re-encodes to exactly the same number of tokens."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        backend = tokenizer.backend
        size = backend.get_vocab_size(with_added_tokens=False)
        texts = [backend.decode([i]) for i in range(size)]
        encoded = backend.encode_batch([t for t in texts], add_special_tokens=False)
        # a token is usable when its text is printable and encodes back to that one token
        self.pool = np.array(
            [
                i
                for i, (t, e) in enumerate(zip(texts, encoded))
                if t.strip() and t.isprintable() and e.ids == [i]
            ],
            dtype=np.int64,
        )
        if len(self.pool) < 16:
            raise ValueError(
                f"the tokenizer has only {len(self.pool)} tokens that round-trip through text; "
                "random prompts need a real vocabulary"
            )

    def encode(self, text: str) -> list[int]:
        return self.tok.backend.encode(text, add_special_tokens=False).ids

    def text(self, rng: np.random.Generator, n: int) -> tuple[str, int]:
        """(text, its token count): n tokens, or as close as re-encoding allows after a few repairs."""
        ids = rng.choice(self.pool, size=n).tolist()
        for _ in range(8):
            again = self.encode(self.tok.backend.decode(ids))
            if again == ids:
                break
            ids = (
                again[:n] if len(again) >= n else again + rng.choice(self.pool, size=n - len(again)).tolist()
            )
        text = self.tok.backend.decode(ids)
        return text, len(self.encode(text))


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, num: int) -> list[int]:
    """Uniform in [mean * (1 - range_ratio), mean * (1 + range_ratio)] as `vllm bench serve
    --random-range-ratio` draws them (range_ratio 0: all equal), at least 1."""
    low = max(1, int(mean * (1.0 - range_ratio)))
    high = max(low, int(mean * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=num).tolist()


def sharegpt_lengths(rng: np.random.Generator, num: int) -> list[tuple[int, int]]:
    """(input, output) token counts: log-normal around the ShareGPT means, within vLLM's ShareGPT bounds."""
    out = []
    for mean, cap in ((SHAREGPT_INPUT_MEAN, SHAREGPT_MAX_INPUT), (SHAREGPT_OUTPUT_MEAN, SHAREGPT_MAX_TOTAL)):
        mu = np.log(mean) - SHAREGPT_SIGMA**2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
        draws = rng.lognormal(mu, SHAREGPT_SIGMA, size=num)
        out.append(np.clip(np.rint(draws), SHAREGPT_MIN_LEN, cap).astype(int))
    ins, outs = out
    outs = np.minimum(outs, SHAREGPT_MAX_TOTAL - ins)
    return list(zip(ins.tolist(), outs.tolist()))


def random_requests(
    sampler: TokenSampler, num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, input_len, range_ratio, num), _lengths(rng, output_len, range_ratio, num)
    out = []
    for n_in, n_out in zip(ins, outs):
        text, n = sampler.text(rng, n_in)
        out.append(BenchRequest(text, n, n_out))
    return out


def sharegpt_synthetic_requests(sampler: TokenSampler, num: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for n_in, n_out in sharegpt_lengths(rng, num):
        text, n = sampler.text(rng, n_in)
        out.append(BenchRequest(text, n, n_out))
    return out


def shared_prefix_requests(
    sampler: TokenSampler,
    num: int,
    num_groups: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """num_groups system prompts of system_len tokens, each shared by num / num_groups questions
    (round robin), as SGLang's generated-shared-prefix: a server with a prefix cache computes each
    system prompt once."""
    rng = np.random.default_rng(seed)
    systems = [sampler.text(rng, system_len)[0] for _ in range(num_groups)]
    out = []
    for i in range(num):
        question = sampler.text(rng, question_len)[0]
        text = systems[i % num_groups] + "\n" + question
        out.append(BenchRequest(text, len(sampler.encode(text)), output_len))
    return out


def jsonl_requests(path: Path, num: int | None, tokenizer=None) -> list[BenchRequest]:
    """Lines of {"prompt": str, "output_len": int > 0}; the first `num` (all when None)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from exc
            prompt, n_out = (
                (row.get("prompt"), row.get("output_len")) if isinstance(row, dict) else (None, None)
            )
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string, got {prompt!r}")
            if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
                raise ValueError(f"{path}:{lineno}: 'output_len' must be an integer >= 1, got {n_out!r}")
            n_in = len(tokenizer.backend.encode(prompt, add_special_tokens=False).ids) if tokenizer else 0
            out.append(BenchRequest(prompt, n_in, n_out))
            if num is not None and len(out) == num:
                break
    if not out:
        raise ValueError(
            f'{path}: no requests (one JSON object per line: {{"prompt": ..., "output_len": ...}})'
        )
    return out
