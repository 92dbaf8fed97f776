"""What a request's consumer sees: token deltas from the engine turned into text events and a final output.

The engine speaks token ids only. After each step it hands every request that
got tokens a `TokenDelta`; the consumer (the offline `LLM`, or a server
coroutine through `EngineLoop`) feeds the deltas to a `RequestStream`, which
detokenizes, matches stop strings and builds the `RequestOutput`. A stop string
is found on the consumer's side, so the stream tells its owner (`stop_hit`) to
finish the request in the engine; the output keeps only the tokens up to the
match whatever the engine generated meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnserve.engine.detokenizer import IncrementalDetokenizer
from attnserve.engine.request import FinishReason, Request
from attnserve.engine.sampling_params import SamplingParams


class RequestFailed(RuntimeError):
    """One request failed inside the engine (the others go on); the message says why."""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log-softmax of the model's logits (before temperature and filters)
    top: tuple[tuple[int, float], ...] = ()  # the k most likely tokens and their logprobs, best first


@dataclass(frozen=True)
class TokenDelta:
    """Engine -> consumer: the tokens one request got since its previous delta."""

    token_ids: tuple[int, ...]
    times: tuple[float, ...]  # perf_counter() when each token was sampled
    logprobs: tuple[TokenLogprob, ...] | None
    cached_tokens: int
    num_preemptions: int
    finish_reason: FinishReason | None = None  # set when the engine finished the request
    matched_stop: int | None = None  # the stop token, when one finished it
    error: str | None = None  # set when the request failed
    spec_verify_steps: int = 0  # speculative decoding: steps that verified drafts for it so far
    spec_draft_tokens: int = 0  # drafts proposed for it so far
    spec_accepted_tokens: int = 0  # of those, accepted

    @classmethod
    def of(cls, req: Request, sent: int) -> TokenDelta:
        """The part of `req`'s output after its first `sent` tokens."""
        logprobs = tuple(req.output_logprobs[sent:]) if req.params.logprobs is not None else None
        return cls(
            token_ids=tuple(req.output_ids[sent:]),
            times=tuple(req.token_times[sent:]),
            logprobs=logprobs,
            cached_tokens=req.cached_len,
            num_preemptions=req.num_preemptions,
            finish_reason=req.finish_reason if req.finished else None,
            matched_stop=req.matched_stop if isinstance(req.matched_stop, int) else None,
            error=req.error,
            spec_verify_steps=req.spec_verify_steps,
            spec_draft_tokens=req.spec_draft_tokens,
            spec_accepted_tokens=req.spec_accepted_tokens,
        )


@dataclass
class RequestOutput:
    index: int  # position of the prompt in the input
    completion: int  # which of the n completions (0 unless n > 1)
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    matched_stop: str | int | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preemptions: int = 0
    ttft_s: float | None = None  # submission -> first token
    tpot_s: float | None = None  # mean time per output token after the first
    token_latencies_s: list[float] = field(default_factory=list)  # gaps between consecutive tokens
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for
    spec_verify_steps: int = 0  # speculative decoding: steps that verified drafts for it
    spec_draft_tokens: int = 0  # drafts proposed for it
    spec_accepted_tokens: int = 0  # of those, accepted

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    def spec_json(self) -> dict:
        """The speculative-decoding counters as `generate --json` shows them when the engine speculates."""
        rate = self.spec_acceptance_rate
        return {"spec_verify_steps": self.spec_verify_steps, "spec_draft_tokens": self.spec_draft_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens,
                "spec_acceptance_rate": None if rate is None else round(rate, 4)}

    def to_json(self) -> dict:
        """The shape `attnserve generate --json` prints, one object per completion."""
        return {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "tpot_s": None if self.tpot_s is None else round(self.tpot_s, 6),
            "cached_tokens": self.cached_tokens,
        }


@dataclass
class StreamEvent:
    index: int
    completion: int
    text: str  # new text since the previous event of this completion
    token_ids: list[int]  # new tokens since the previous event
    finished: bool
    output: RequestOutput | None = None  # set on the last event
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when asked for


class RequestStream:
    """One completion's consumer-side state: deltas in, text events out."""

    def __init__(self, tokenizer, params: SamplingParams, prompt: str | None, prompt_ids: list[int],
                 arrival_time: float, index: int = 0, completion: int = 0):
        self.params = params
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.arrival_time = arrival_time
        self.index, self.completion = index, completion
        self.detok = IncrementalDetokenizer(tokenizer, params.stop, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.times: list[float] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.output: RequestOutput | None = None  # set once finished
        self.stop_hit = False  # a stop string ended it here; the engine still has to be told

    @property
    def finished(self) -> bool:
        return self.output is not None

    def push(self, delta: TokenDelta) -> StreamEvent | None:
        """The event for this delta (None once finished: later tokens are past a stop string)."""
        if self.finished:
            return None
        if delta.error is not None:
            raise RequestFailed(delta.error)
        start = len(self.token_ids)
        ids = list(delta.token_ids)
        self.token_ids += ids
        self.times += delta.times
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs += delta.logprobs
        stop_token = delta.matched_stop is not None
        text_ids = ids[:-1] if stop_token else ids  # a stop token is not text
        reason = delta.finish_reason.value if delta.finish_reason is not None else None
        matched: str | int | None = delta.matched_stop
        if self.detok.push(text_ids) is not None:  # a stop string: keep the tokens up to its match
            del self.token_ids[self.detok.num_tokens_at_stop :]
            del self.times[self.detok.num_tokens_at_stop :]
            if self.logprobs is not None:
                del self.logprobs[self.detok.num_tokens_at_stop :]
            reason, matched = FinishReason.STOP.value, self.detok.matched_stop
            self.stop_hit = delta.finish_reason is None
        finished = reason is not None
        new_ids = self.token_ids[start:]
        if finished:
            self.output = self._output(reason, matched, delta)
        return StreamEvent(self.index, self.completion, self.detok.take_streamable(finished), new_ids, finished,
                           self.output, self.logprobs[start:] if self.logprobs is not None else None)

    def _output(self, reason: str, matched, delta: TokenDelta) -> RequestOutput:
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return RequestOutput(
            index=self.index,
            completion=self.completion,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids),
            text=self.detok.text,
            token_ids=list(self.token_ids),
            finish_reason=reason,
            matched_stop=matched,
            cached_tokens=delta.cached_tokens,
            num_preemptions=delta.num_preemptions,
            ttft_s=self.times[0] - self.arrival_time if self.times else None,
            tpot_s=sum(gaps) / len(gaps) if gaps else None,
            token_latencies_s=gaps,
            logprobs=self.logprobs,
            spec_verify_steps=delta.spec_verify_steps,
            spec_draft_tokens=delta.spec_draft_tokens,
            spec_accepted_tokens=delta.spec_accepted_tokens,
        )
