"""Engine: scheduler + model runner + sampler, stepped one batch at a time, in token ids.

Single-threaded: `add_request`, `abort` and `step` are called from one loop
(the offline LLM API, or the server's engine loop). Each `step` schedules a
batch, runs it, samples, and finishes requests that hit a stop condition, so
pages are freed before the next step is planned.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from attnserve.engine.config import EngineConfig
from attnserve.engine.detokenizer import encode
from attnserve.engine.request import FinishReason, Request
from attnserve.engine.runner import ModelRunner
from attnserve.engine.sampler import Sampler
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.scheduler import Scheduler, SchedulerConfig
from attnserve.engine.setup import EngineParts, build_parts
from attnserve.engine.tensor_parallel import start_world

log = logging.getLogger("attnserve.engine")


def _recent() -> deque:
    return deque(maxlen=STEP_HISTORY)


STEP_HISTORY = 1 << 16  # steps remembered per mode: a long-running server must not grow without bound


@dataclass
class StepTimes:
    """Wall time of recent steps by mode (the host waits for the step's tokens, so these are real)."""

    decode: deque = field(default_factory=_recent)
    decode_batch: deque = field(default_factory=_recent)
    extend: deque = field(default_factory=_recent)
    mixed: deque = field(default_factory=_recent)


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded=None, **overrides):
        """`loaded`: an already loaded model bundle (anything with .model and .tokenizer), else config.model."""
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise ValueError("pass either an EngineConfig or keyword settings, not both")
        self.config = config
        self.world = start_world(config, loaded)  # tp > 1: the other ranks, spawned and joined (None at tp 1)
        try:
            self.parts: EngineParts = build_parts(config, loaded)
        except BaseException:
            if self.world is not None:
                self.world.abort()
            raise
        p = self.parts
        self.tokenizer = p.model.tokenizer
        self.eos_token_ids = set(p.model.eos_token_ids)
        self.vocab_size = p.model.vocab_size
        self.max_context_len = p.kv.max_context_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=p.kv.pool.page_size,
                chunked_prefill_size=config.chunked_prefill_size,
                max_prefill_tokens=config.max_prefill_tokens,
                disable_radix_cache=config.disable_radix_cache,
            ),
            p.kv.allocator,
            p.kv.req_pool,
        )
        self.runner = ModelRunner.from_parts(p)
        self.sampler = Sampler(p.model.device, seed=config.seed)
        self.requests: dict[int, Request] = {}
        self.step_times = StepTimes()
        self._rids = itertools.count()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit); the engine cannot step after."""
        if self.world is not None:
            self.world.close()

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
        return encode(self.tokenizer, prompt)

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, rid=None) -> Request:
        """Tokenize and validate a request without touching the engine's state (any thread may call it)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        params.validate()
        vocab = self.vocab_size
        params.check_vocab(vocab)
        if params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: the engine takes one completion per request; "
                             "LLM.generate expands n")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        req = Request(rid=next(self._rids) if rid is None else rid, prompt_ids=ids, params=params, prompt=text)
        self.scheduler.check_fits(req)
        return req

    def add(self, req: Request) -> Request:
        """Queue a request made by make_request (on the engine's thread)."""
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.scheduler.add(req)
        self.requests[req.rid] = req
        return req

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, rid=None) -> Request:
        return self.add(self.make_request(prompt, params, rid))

    def abort(self, rid) -> bool:
        """Stop request `rid` now and free its pages; False if it is unknown or already finished."""
        req = self.scheduler.abort(rid)
        if req is None:
            return False
        self._forget(req)
        return True

    def stop_request(self, rid, stop: str) -> bool:
        """A consumer matched stop string `stop` in the request's text: finish it (False if already done)."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        self._finish(req, FinishReason.STOP, stop)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _forget(self, req: Request) -> None:
        self.sampler.forget(req.rid)
        self.requests.pop(req.rid, None)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that got a new token or failed (finished ones included).

        A failure of the batch itself (scheduling, the forward pass) raises; a failure that belongs to one
        request (its sampling, its stop checks) finishes that request with FinishReason.ERROR and the
        reason in `Request.error`, frees its pages, and the others go on.
        """
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request can be scheduled although nothing is running (pool too small?)")
            return []
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        self.scheduler.commit(batch)
        sampling = [r for r, s in zip(batch.reqs, batch.sample) if s]
        picks = self._sample(logits, sampling) if sampling else []
        now = time.perf_counter()
        times = {"decode": self.step_times.decode, "extend": self.step_times.extend,
                 "mixed": self.step_times.mixed}[batch.mode.value]
        times.append(now - t0)
        if batch.mode.value == "decode":
            self.step_times.decode_batch.append(batch.batch_size)
        for r, pick in zip(sampling, picks):
            if pick is None:
                continue  # failed while sampling
            try:
                self._append_token(r, *pick, now)
            except Exception as exc:  # noqa: BLE001 - one request's failure is that request's alone
                self._fail(r, exc)
        return sampling

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, object] | None]:
        """(token, logprob) per request; a request whose sampling raises is failed and gets None."""
        try:
            return self._sample_rows(logits, reqs)
        except Exception:  # noqa: BLE001 - find the request(s) it belongs to, row by row
            picks = []
            for i, r in enumerate(reqs):
                try:
                    picks += self._sample_rows(logits[i : i + 1], [r])
                except Exception as exc:  # noqa: BLE001
                    self._fail(r, exc)
                    picks.append(None)
            return picks

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple[int, object]]:
        params = [r.params for r in reqs]
        tokens = self.sampler.sample(logits, [r.rid for r in reqs], params)
        return list(zip(tokens, self.sampler.logprobs(logits, tokens, params)))

    def _append_token(self, r: Request, token: int, logprob, now: float) -> None:
        r.output_ids.append(token)
        if logprob is not None:
            r.output_logprobs.append(logprob)
        if r.first_token_time is None:
            r.first_token_time = now
        r.token_times.append(now)
        p = r.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self._finish(r, FinishReason.STOP, token)
        elif len(r.output_ids) >= p.max_new_tokens or r.seq_len >= self.max_context_len:
            self._finish(r, FinishReason.LENGTH)

    def _fail(self, r: Request, exc: Exception) -> None:
        log.warning("request %s failed: %r", r.rid, exc)
        r.error = f"{type(exc).__name__}: {exc}"
        if not r.finished:
            self._finish(r, FinishReason.ERROR)

    def _finish(self, r: Request, reason: FinishReason, matched=None) -> None:
        self.scheduler.finish(r, reason, matched)
        self._forget(r)

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    # ---- reporting --------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        tree = self.scheduler.tree
        return tree.stats.as_dict() if tree is not None else {"disabled": True}

    def pages_leaked(self) -> int:
        """Pages neither free nor held by the prefix cache (0 whenever nothing is running)."""
        if self.scheduler.running:
            raise RuntimeError("leak check needs an idle engine")
        self.scheduler.allocator.check_leaks()
        cached = self.scheduler.tree.num_pages if self.scheduler.tree else 0
        return self.scheduler.allocator.num_used - cached

    def state(self) -> dict:
        """Requests and KV pages right now. `pages_in_use`: held by running or queued requests (0 once every
        request has ended); `pages_cached`: held by the prefix cache alone (evictable)."""
        sched = self.scheduler
        alloc = sched.allocator
        cached = sched.tree.evictable_pages() if sched.tree is not None else 0
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_cache": {"page_size": self.parts.kv.pool.page_size, "pages_total": alloc.total,
                         "pages_free": alloc.num_free, "pages_cached": cached,
                         "pages_in_use": alloc.num_used - cached},
            "prefix_cache": self.cache_stats(),
        }

    def flush_cache(self) -> None:
        if self.scheduler.tree is not None:
            self.scheduler.tree.reset()

    def stats(self) -> dict:
        c = self.scheduler.counters
        return {
            "steps": c.steps,
            "mixed_steps": c.mixed_steps,
            "preemptions": c.preemptions,
            "prefill_tokens": c.prefill_tokens,
            "decode_tokens": c.decode_tokens,
            "finished": c.finished,
            "aborted": c.aborted,
            "graphed_steps": self.runner.steps_graphed,
            "eager_steps": self.runner.steps_eager,
            "cache": self.cache_stats(),
        }

    @property
    def device(self) -> torch.device:
        return self.parts.model.device
