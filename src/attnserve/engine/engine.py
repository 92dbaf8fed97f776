"""Engine: scheduler + model runner + sampler, stepped one batch at a time, in token ids.

Single-threaded: `add_request`, `abort` and `step` are called from one loop
(the offline LLM API, or the server's engine loop). A step is launched
(scheduled, its metadata built, the backend planned, the forward pass and the
sampler queued on the device) and later completed (its sampled ids read on
the host, stop conditions checked, finished requests' pages freed).

Overlap scheduling (on unless `disable_overlap_schedule`): each `step` launches
step n+1 before completing step n, so the host schedules and plans while the
device still runs step n, and the device never waits for the host. Decoding
requests of step n+1 read their input token (sampled in step n) on the device;
the host reads step n's ids once, through a pinned buffer and an event, after
n+1 is queued. Outputs are the same as without overlap: a request that step n
finishes also ran in step n+1, whose token for it is dropped; a request whose
pending token is sure to end it by length is not scheduled again. Freeing its
pages while n+1 still runs is safe because all device work is one stream, so
anything that reuses them runs after n+1.

Speculative decoding (`--speculative-algorithm ngram`): the drafter proposes tokens after each decoding
request's last one, and one TARGET_VERIFY step computes logits for all of them; the accepted drafts plus
the target's own next token are appended with the usual stop checks. A verify step needs the previous
step's accepted tokens on the host, so a speculating engine completes every step before launching the
next (no overlap). When prompts wait, verify steps alternate with the scheduler's usual steps.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from attnserve.batch import ForwardMode
from attnserve.engine.config import EngineConfig
from attnserve.engine.request import FinishReason, Request
from attnserve.engine.runner import ModelRunner
from attnserve.engine.sampler import DeviceLogprobs, Sampler
from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.schedule_policy import StepBudget, checked_step_budget, resolve_step_budget
from attnserve.engine.scheduler import ScheduleBatch, Scheduler, SchedulerConfig
from attnserve.engine.speculative import build_drafter
from attnserve.engine.speculative.draft_tree import DraftTree
from attnserve.engine.speculative.stats import SpecStats
from attnserve.engine.speculative.verify import complete_verify
from attnserve.engine.startup import EngineParts, build_parts
from attnserve.engine.tensor_parallel import start_world
from attnserve.models.cpu_weights import batch_variant_parts
from attnserve.models.tokenizer import encode
from attnserve.transfers import HostCopy, to_device

log = logging.getLogger("attnserve.engine")


def _recent() -> deque:
    return deque(maxlen=STEP_HISTORY)


STEP_HISTORY = 1 << 16  # steps remembered per mode: a long-running server must not grow without bound


@dataclass
class LaunchedStep:
    """A step queued on the device whose tokens the host has not read yet."""

    batch: ScheduleBatch
    sampling: list[Request]  # the requests it samples for, in token order
    failed: set[int]  # ids of those whose sampling failed at launch (already finished with ERROR)
    copy: HostCopy | None  # the sampled ids (and logprobs) on their way to the host; None: nothing sampled
    logprobs: DeviceLogprobs | None
    launched_at: float
    logits: torch.Tensor | None = None  # TARGET_VERIFY: every token's logits [T, vocab], accepted on completion


@dataclass
class StepTimes:
    """Wall time of recent steps by mode, from launch (or the previous step's completion, if later) to the
    moment its tokens reached the host: with overlap, the interval between consecutive steps' tokens."""

    decode: deque = field(default_factory=_recent)
    decode_batch: deque = field(default_factory=_recent)
    extend: deque = field(default_factory=_recent)
    mixed: deque = field(default_factory=_recent)
    target_verify: deque = field(default_factory=_recent)
    # since start, by mode: steps and their summed wall time. Idle time between steps is in no step, so the
    # sum over modes against a wall-clock interval is how busy the engine was (what a served run compares
    # with the offline engine)
    counts: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    def add(self, mode: str, seconds: float) -> None:
        getattr(self, mode).append(seconds)
        self.counts[mode] = self.counts.get(mode, 0) + 1
        self.seconds[mode] = self.seconds.get(mode, 0.0) + seconds


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
        if config.enable_deterministic_inference:
            log.info("deterministic inference: no prefix-cache reuse, no prompt chunking, one CPU weight format "
                     "in fixed-size row blocks, the extend attention path for every step, preempted requests "
                     "recomputed in the steps they first ran in, and seeded rows sampled one at a time")
            gaps = batch_variant_parts(p.model.module)
            if gaps:
                log.warning("deterministic inference: outputs may still depend on the batch here, no bitwise "
                            "promise: %s", "; ".join(gaps))
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_size=p.kv.pool.page_size,
                chunked_prefill_size=config.chunked_prefill_size,
                max_prefill_tokens=config.max_prefill_tokens,
                step_budget=p.step_budget,
                schedule_policy=config.schedule_policy,
                disable_radix_cache=config.disable_radix_cache,
                deterministic=config.enable_deterministic_inference,
            ),
            p.kv.allocator,
            p.kv.req_pool,
        )
        self.runner = ModelRunner.from_parts(p)
        self.sampler = Sampler(p.model.device, seed=config.seed,
                               deterministic=config.enable_deterministic_inference)
        self.requests: dict[int, Request] = {}
        self.step_times = StepTimes()
        self._rids = itertools.count()
        # speculative decoding: the engine asks its drafter only through propose / observe / forget, so
        # another drafter may replace it (None: no speculation)
        self.drafter = build_drafter(config)
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.spec_stats = SpecStats()
        self._last_verified = False
        self._uniform_verify: bool | None = None
        # a verify step needs the previous step's accepted tokens on the host: speculating steps complete
        # each step before launching the next
        self.overlap = not config.disable_overlap_schedule and self.drafter is None
        if self.drafter is not None and not config.disable_overlap_schedule:
            log.info("overlap scheduling: off while speculating (a verify step needs the previous step's "
                     "accepted tokens on the host)")
        self.host_copy = HostCopy  # how a step's results travel to the host (tests slow it down)
        self._in_flight: LaunchedStep | None = None
        self._last_done = 0.0

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit); the engine cannot step after."""
        if self.world is not None:
            self.world.close()

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
        return encode(self.tokenizer, prompt)

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None, rid=None,
                     speculative: bool = True) -> Request:
        """Tokenize and validate a request without touching the engine's state (any thread may call it).
        `speculative=False`: never draft for this request (it decodes one token per step)."""
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
        req = Request(rid=next(self._rids) if rid is None else rid, prompt_ids=ids, params=params, prompt=text,
                      speculative=speculative)
        self.scheduler.check_fits(req)
        return req

    def add(self, req: Request) -> Request:
        """Queue a request made by make_request (on the engine's thread)."""
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.scheduler.add(req)
        self.requests[req.rid] = req
        return req

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, rid=None,
                    speculative: bool = True) -> Request:
        return self.add(self.make_request(prompt, params, rid, speculative))

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
        return self._in_flight is not None or self.scheduler.has_work()

    @property
    def step_budget(self) -> StepBudget:
        """Prompt tokens a step that decodes may add (resolved at start-up from --max-num-batched-tokens)."""
        return self.scheduler.config.step_budget

    def set_step_budget(self, value) -> StepBudget:
        """Swap the step budget of an idle engine (a benchmark measures several on one model and pool):
        `value` as --max-num-batched-tokens takes it (N, <= 0, "auto", "auto:S", None: the device default)."""
        if self.has_work():
            raise RuntimeError("the step budget changes only while the engine is idle")
        value = checked_step_budget(value, self.config.max_running_requests)
        budget = resolve_step_budget(value, self.config.max_running_requests, self.device.type,
                                     piecewise=self.runner.piecewise is not None)
        self.scheduler.config.step_budget = budget
        return budget

    def _forget(self, req: Request) -> None:
        self.sampler.forget(req.rid)
        if self.drafter is not None:
            self.drafter.forget(req.rid)
        self.requests.pop(req.rid, None)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Complete one batch; returns the requests that got a new token or failed (finished ones included).

        Without overlap: launch a batch and complete it. With overlap: launch the next batch, then
        complete the one launched by the previous call (so the first call after idling returns []).
        A failure of the batch itself (scheduling, the forward pass) raises; a failure that belongs to one
        request (its sampling, its stop checks) finishes that request with FinishReason.ERROR and the
        reason in `Request.error`, frees its pages, and the others go on.
        """
        if not self.overlap or self.drafter is not None:
            done = self.drain()  # a step launched with overlap before a drafter was set
            launched = self._launch(in_flight=False)
            return done + (self._complete(launched) if launched is not None else [])
        previous, self._in_flight = self._in_flight, None
        try:
            self._in_flight = self._launch(in_flight=previous is not None)
        finally:  # even when launching fails, the step already running is completed (its pages settled)
            done = self._complete(previous) if previous is not None else []
        return done

    def drain(self) -> list[Request]:
        """Complete the step in flight, if any, launching nothing (what `step` would return for it)."""
        step, self._in_flight = self._in_flight, None
        return self._complete(step) if step is not None else []

    def _launch(self, in_flight: bool) -> LaunchedStep | None:
        """Schedule a batch and queue its forward pass and sampling; reads nothing back from the device."""
        batch = self._schedule_verify() if self.drafter is not None else None
        if batch is None:
            batch = self.scheduler.schedule(in_flight=in_flight)
        self._last_verified = batch is not None and batch.mode is ForwardMode.TARGET_VERIFY
        if batch is None:
            if not in_flight and self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("no request can be scheduled although nothing is running (pool too small?)")
            return None
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        if batch.mode is ForwardMode.TARGET_VERIFY:
            return LaunchedStep(batch, list(batch.reqs), set(), None, None, t0, logits=logits)
        self.scheduler.commit(batch)
        sampling = [r for r, s in zip(batch.reqs, batch.sample) if s]
        if not sampling:
            return LaunchedStep(batch, [], set(), None, None, t0)
        rows = to_device([r.row for r in sampling], self.device)  # [S] (a request failing below drops its row)
        tokens, logprobs, failed = self._sample(logits, sampling)
        self.runner.record_sampled(rows, tokens)
        for r in sampling:
            if id(r) not in failed:
                r.num_pending += 1
        copy = self.host_copy({"tokens": tokens, **(logprobs.tensors() if logprobs is not None else {})})
        return LaunchedStep(batch, sampling, failed, copy, logprobs, t0)

    def _complete(self, step: LaunchedStep) -> list[Request]:
        """Read a launched step's tokens (waiting for them if need be) and apply them to its requests."""
        host = step.copy.wait() if step.copy is not None else {}
        now = time.perf_counter()
        batch = step.batch
        self.step_times.add(batch.mode.value, now - max(step.launched_at, self._last_done))
        self._last_done = now
        if batch.mode.value == "decode":
            self.step_times.decode_batch.append(batch.batch_size)
        if step.logits is not None:
            return self._complete_verify(step, now)
        if not step.sampling:
            return []
        tokens = host["tokens"].tolist()
        logprobs = step.logprobs.on_host(tokens, host) if step.logprobs is not None else [None] * len(tokens)
        out = []
        for r, token, logprob in zip(step.sampling, tokens, logprobs):
            if id(r) in step.failed:
                out.append(r)  # failed at launch: its consumer hears about it now
                continue
            if r.finished:
                continue  # finished (stop, abort, or its previous token) after this step was launched
            r.num_pending -= 1
            try:
                self._append_token(r, token, logprob, now)
            except Exception as exc:  # noqa: BLE001 - one request's failure is that request's alone
                self._fail(r, exc)
            out.append(r)
        return out

    def _sample(self, logits: torch.Tensor, reqs: list[Request]):
        """Sampled ids `[S]` (device), their logprobs where asked, and the ids of requests whose sampling
        raised (each failed alone; its token is a placeholder that is never read)."""
        try:
            return (*self._sample_rows(logits, reqs), set())
        except Exception as exc:  # noqa: BLE001 - find the request(s) it belongs to, row by row
            log.debug("sampling the batch failed (%r); sampling row by row", exc)
        tokens, parts, failed = [], [], set()
        for i, r in enumerate(reqs):
            try:
                tok, lp = self._sample_rows(logits[i : i + 1], [r])
            except Exception as exc:  # noqa: BLE001
                self._fail(r, exc)
                failed.add(id(r))
                tok, lp = torch.zeros(1, dtype=torch.int64, device=logits.device), None
            tokens.append(tok)
            parts.append(lp)
        return torch.cat(tokens), DeviceLogprobs.merge(parts), failed

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, DeviceLogprobs | None]:
        params = [r.params for r in reqs]
        tokens = self.sampler.sample(logits, [r.rid for r in reqs], params)
        return tokens, self.sampler.logprobs(logits, tokens, params)

    # ---- speculative decoding --------------------------------------------------------------------
    def _schedule_verify(self) -> ScheduleBatch | None:
        """A verify step, unless the last step verified and prompts wait (then the scheduler's usual step
        runs, prefill chunks with it, so that neither starves)."""
        sched = self.scheduler
        if self._last_verified and (
                (sched.waiting and sched.req_pool.num_free > 0) or any(r.is_prefilling for r in sched.running)):
            return None
        return sched.schedule_verify(self._propose, self.num_draft_tokens, uniform=self._verify_graphed())

    def _verify_graphed(self) -> bool:
        """Whether verify steps can replay a captured graph: one shape per (batch, 1 + K), so every request
        is padded to K drafts. Eager steps verify what each request has."""
        if self._uniform_verify is None:  # asked once: graphs are captured at start-up
            graphs = self.runner.graph_runner
            q = 1 + self.num_draft_tokens
            self._uniform_verify = graphs is not None and (graphs.can_run(1, q, False) or graphs.can_run(1, q, True))
        return self._uniform_verify

    def _propose(self, r: Request) -> DraftTree | None:
        return self.drafter.propose(r) if r.speculative else None

    def _complete_verify(self, step: LaunchedStep, now: float) -> list[Request]:
        """What the verify step's logits mean for each request (engine/speculative/verify.py)."""
        return complete_verify(step.batch, step.logits, now, drafter=self.drafter, stats=self.spec_stats,
                               sampler=self.sampler, runner=self.runner, scheduler=self.scheduler,
                               append_token=self._append_token, fail=self._fail)

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
        elif len(r.output_ids) >= p.max_new_tokens or len(r.prompt_ids) + len(r.output_ids) >= self.max_context_len:
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
            "piecewise_steps": self.runner.steps_piecewise,
            "overlap_schedule": self.overlap and self.drafter is None,
            "step_budget": self.step_budget.label,
            "steps_by_mode": dict(self.step_times.counts),
            "step_seconds_by_mode": {mode: round(s, 6) for mode, s in self.step_times.seconds.items()},
            "cache": self.cache_stats(),
            **({"speculative": self.spec_stats.as_dict()} if self.drafter is not None else {}),
        }

    @property
    def device(self) -> torch.device:
        return self.parts.model.device
