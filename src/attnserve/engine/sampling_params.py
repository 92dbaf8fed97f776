"""SamplingParams: how one request picks its tokens and when it stops.

Validated at construction so that a bad value fails when the request is made,
with the field's name, not deep inside a batched step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # a seeded request samples the same tokens whatever batch it shares
    stop: list[str] = field(default_factory=list)  # stop strings; the match is cut from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # completions per prompt (each its own request; the prompt is shared via the prefix cache)
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, allowed: str):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            bad("max_new_tokens", "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad("top_k", "-1 or 0 (no limit) or an integer >= 1")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            bad("seed", "None or an integer >= 0")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of token ids >= 0")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad("n", "an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def with_seed(self, seed: int | None) -> SamplingParams:
        """A copy for one of the n completions (each gets its own seed so they differ)."""
        from dataclasses import replace

        return replace(self, seed=seed, n=1)
