"""Request: one prompt's life in the engine, from arrival to its finish reason.

A request owns one reference to each KV page in `pages` (shared prefix pages
included) and one row of the request->slot table while it runs. Preemption and
abort hand both back; `kv_len` says how many of `fill_ids` already have their
K/V in the pool, so a preempted request resumes by recomputing the rest.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from attnserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting to be recomputed)
    RUNNING = "running"  # holds a row and pages; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens reached (or the context limit)
    ABORT = "abort"
    ERROR = "error"  # this request failed inside the engine (Request.error says why); the others go on


@dataclass(eq=False)
class Request:
    """Compared by identity: the scheduler's list-membership checks must not compare every field
    (a cost that grows with every running request), and two requests are never the same one."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None  # why the request failed, with finish_reason ERROR
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when params.logprobs is set
    # tokens sampled on the device whose ids the host has not read yet (overlap scheduling schedules the
    # next step before the last one's tokens arrive); they count in seq_len but not in output_ids
    num_pending: int = 0

    # KV state (valid while RUNNING)
    row: int | None = None  # row of req_to_token
    pages: list[int] = field(default_factory=list)  # pages this request holds a reference to, in order
    kv_len: int = 0  # tokens of fill_ids whose K/V is in the pool
    cached_len: int = 0  # of those, tokens that came from the prefix cache at the last admission
    num_preemptions: int = 0
    admit_order: int = 0  # increases with every admission; the largest is the newest

    # speculative decoding (when the engine speculates): False opts this request out
    speculative: bool = True
    spec_verify_steps: int = 0  # steps that verified drafts for it
    spec_draft_tokens: int = 0  # drafts proposed for it (padding excluded)
    spec_accepted_tokens: int = 0  # of those, accepted

    # timing
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError(f"request {self.rid}: the prompt has no tokens; give at least one")

    @property
    def fill_ids(self) -> list[int]:
        """Every known token whose K/V this request needs: prompt plus what it generated so far."""
        return self.prompt_ids + self.output_ids

    def tokens(self, lo: int, hi: int) -> list[int]:
        """fill_ids[lo:hi] without building fill_ids (decode steps need one token of a long sequence)."""
        n = len(self.prompt_ids)
        if hi <= n:
            return self.prompt_ids[lo:hi]
        if lo >= n:
            return self.output_ids[lo - n : hi - n]
        return self.prompt_ids[lo:] + self.output_ids[: hi - n]

    @property
    def seq_len(self) -> int:
        """Tokens so far, pending ones (sampled, not yet read by the host) included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    def pending_token_ends_it(self, max_context_len: int) -> bool:
        """The pending token is sure to finish this request by length: scheduling another step is waste."""
        return self.num_pending > 0 and (
            self.num_generated >= self.params.max_new_tokens or self.seq_len >= max_context_len)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1 or not self.num_generated

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, matched: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.num_pending = 0  # a token still in flight is dropped when it arrives
        self.finish_reason = reason
        self.matched_stop = matched
        self.finish_time = time.perf_counter()

    # ---- timing summaries ------------------------------------------------------------------
    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts over proposed ones (None when nothing was verified)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        gaps = self.inter_token_latencies_s
        return sum(gaps) / len(gaps) if gaps else None
