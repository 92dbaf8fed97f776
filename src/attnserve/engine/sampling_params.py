"""SamplingParams: how one request picks its tokens and when it stops.

Frozen and validated at construction, so a bad value fails when the request is
made, with the field's name, and nothing can change it on its way into a
batched step (where one bad request would otherwise fail every request of the
batch). Bounds that depend on the model (token ids against the vocabulary) are
checked again by the engine when the request is added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Below this temperature, logits / temperature overflows float32 into inf/NaN: such
# requests are greedy (what the limit of sampling at temperature -> 0 is anyway).
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit seeds
MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_NEW_TOKENS = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_k: int = -1  # -1 or 0 = no limit; larger than the vocabulary = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # a seeded request samples the same tokens whatever batch it shares
    stop: tuple[str, ...] = ()  # stop strings; the earliest match in the text ends it and is cut
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # completions per prompt (each its own request; the prompt is shared via the prefix cache)
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the k most likely

    def __post_init__(self):
        # accept a string or any iterable for the two lists; store tuples so nothing can mutate them
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is None:
                value = ()
            if not isinstance(value, (list, tuple)):
                self._bad(name, "a list")
            object.__setattr__(self, name, tuple(value))
        self.validate()

    def _bad(self, name: str, allowed: str):
        raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

    def validate(self) -> None:
        if not _is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            self._bad("max_new_tokens", f"an integer in [1, {MAX_NEW_TOKENS}]")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            self._bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            self._bad("top_k", "-1 or 0 (no limit) or an integer >= 1")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            self._bad("top_p", "a number in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            self._bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            self._bad("seed", "None or an integer in [0, 2**64 - 1]")
        if not all(isinstance(s, str) and s for s in self.stop):
            self._bad("stop", "a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            self._bad("stop_token_ids", "a list of token ids >= 0")
        for flag in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                self._bad(flag, "true or false")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            self._bad("n", f"an integer in [1, {MAX_N}]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            self._bad("logprobs", f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")

    def check_vocab(self, vocab_size: int | None) -> None:
        """The model-dependent bound: stop token ids must be tokens of this vocabulary."""
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            self._bad("stop_token_ids", f"token ids in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def for_completion(self, j: int) -> SamplingParams:
        """Completion j of n: its own seed (seed + j, wrapped to 64 bits) so the n completions differ."""
        seed = None if self.seed is None else (self.seed + j) % (MAX_SEED + 1)
        return replace(self, seed=seed, n=1)
