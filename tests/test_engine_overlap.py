"""Overlap scheduling on the CPU: the same tokens and finish reasons as without it, no page leaked, and no
token read on the host before its step has finished.

On the CPU a step's tokens are ready as soon as it is launched, so a stand-in for the
device-to-host copy (`SlowCopy`) holds them back: its host buffer is garbage until `wait()`,
which is what a pinned buffer looks like before its CUDA event fires.
"""

import random
from typing import ClassVar

import pytest
import torch
from engine_helpers import VOCAB, make_engine, prompts

from attnserve.engine.request import FinishReason
from attnserve.engine.sampling_params import SamplingParams
from attnserve.transfers import HostCopy

PROMPTS = prompts(10, seed=21, shared_prefix=6, lo=3, hi=30)
SENTINEL = VOCAB + 1000  # not a token: a read before the copy landed would put it into an output


def _run(overlap: bool, ps, params, stagger: int = 2, aborts=(), **settings):
    """Submit `stagger` prompts per step (aborting request i at the step named in `aborts`), run to the end."""
    e = make_engine(disable_overlap_schedule=not overlap, **settings)
    reqs, pending, step = [], list(zip(ps, params)), 0
    while pending or e.has_work():
        for p, sp in pending[:stagger]:
            reqs.append(e.add_request(p, sp))
        pending = pending[stagger:]
        for i, at in aborts:
            if at == step and i < len(reqs):
                e.abort(reqs[i].rid)
        e.step()
        step += 1
    assert e.pages_leaked() == 0
    assert all(r.num_pending == 0 for r in reqs)
    return [(r.output_ids, r.finish_reason) for r in reqs], e


def _stop_params(ref_outputs, seed: int = 0, base: int = 4):
    """Per request: a stop token it really produces mid-way, a different max_new_tokens each."""
    rng = random.Random(seed)
    out = []
    for i, ids in enumerate(ref_outputs):
        stop = (ids[rng.randrange(1, len(ids))],) if i % 3 else ()  # every third runs to its length
        out.append(SamplingParams(max_new_tokens=base + i % 7, stop_token_ids=stop, ignore_eos=True))
    return out


def _reference(ps, n=30):
    outs, _ = _run(False, ps, [SamplingParams(max_new_tokens=n, ignore_eos=True)] * len(ps))
    return [ids for ids, _ in outs]


@pytest.mark.parametrize("base,settings", [
    (4, {}),
    (4, {"chunked_prefill_size": 16}),
    (20, {"max_total_tokens": 128, "page_size": 4}),  # a small pool: preemption while tokens are in flight
    (4, {"disable_radix_cache": True, "max_running_requests": 3}),
])
def test_overlap_on_and_off_give_the_same_tokens_and_finish_reasons(base, settings):
    params = _stop_params(_reference(PROMPTS), base=base)
    off, e_off = _run(False, PROMPTS, params, **settings)
    on, e_on = _run(True, PROMPTS, params, **settings)
    assert on == off
    assert {FinishReason.STOP, FinishReason.LENGTH} <= {reason for _, reason in on}  # both kinds of ending
    assert e_on.overlap and not e_off.overlap
    if "max_total_tokens" in settings:
        assert e_on.scheduler.counters.preemptions > 0


def test_a_request_ending_by_length_is_not_scheduled_again():
    """Its last token is still in flight when the next step is scheduled: the scheduler knows it ends it."""
    e = make_engine()
    e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=5, ignore_eos=True))
    decodes = 0
    forward = e.runner.forward

    def counting(batch):
        nonlocal decodes
        decodes += batch.num_decodes
        return forward(batch)

    e.runner.forward = counting
    e.run_until_done()
    assert decodes == 4  # the prefill samples token 1, four decodes sample 2..5, none more


def test_aborts_while_a_step_is_in_flight_free_every_page():
    ps = PROMPTS[:6]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * len(ps)
    full = _reference(ps, n=12)
    for step in range(1, 8, 2):
        on, _ = _run(True, ps, params, aborts=[(0, step), (3, step + 1)])
        for i, (ids, reason) in enumerate(on):
            if reason is FinishReason.ABORT:
                assert ids == full[i][: len(ids)]  # what it got before the abort is what it would have got
            else:
                assert ids == full[i]


class SlowCopy:
    """A device-to-host copy whose data lands only when waited for (a slow step, a late CUDA event).

    Logs when each copy is made (its step launched) and waited for, in order.
    """

    log: ClassVar[list[tuple[str, int]]] = []

    def __init__(self, tensors):
        self.index = sum(1 for kind, _ in self.log if kind == "launch")
        self.log.append(("launch", self.index))
        self._real = HostCopy({k: t.clone() for k, t in tensors.items()})
        # before the copy lands, the host buffer holds garbage
        self._host = {k: torch.full_like(t, SENTINEL) for k, t in tensors.items()}

    def ready(self) -> bool:
        return False

    def wait(self):
        self.log.append(("wait", self.index))
        for k, t in self._real.wait().items():
            self._host[k].copy_(t)
        return self._host


def test_overlap_never_reads_a_token_before_its_step_finished():
    ref = _reference(PROMPTS)
    params = _stop_params(ref, seed=1)
    off, _ = _run(False, PROMPTS, params)

    SlowCopy.log = []
    e = make_engine()
    e.host_copy = SlowCopy
    reqs = [e.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    e.run_until_done()
    assert [(r.output_ids, r.finish_reason) for r in reqs] == off  # no SENTINEL, the same tokens and ends
    assert all(0 <= t < VOCAB for r in reqs for t in r.output_ids)
    log = SlowCopy.log
    launches = [i for kind, i in log if kind == "launch"]
    assert launches == list(range(len(launches))) and len(launches) >= 8
    assert sorted(i for kind, i in log if kind == "wait") == launches  # every step read exactly once
    for k in launches[:-1]:
        # step k+1 was launched (scheduled, planned, queued) before step k's tokens were read
        assert log.index(("launch", k + 1)) < log.index(("wait", k))
    assert e.pages_leaked() == 0


def test_logprobs_and_seeded_sampling_match_with_overlap_on_and_off():
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=s,
                             logprobs=3 if s % 2 else None) for s in range(4)]
    ps = PROMPTS[:4]

    def run(overlap):
        e = make_engine(disable_overlap_schedule=not overlap)
        reqs = [e.add_request(p, sp) for p, sp in zip(ps, params)]
        e.run_until_done()
        return [(r.output_ids, [(lp.token_id, round(lp.logprob, 5), lp.top) for lp in r.output_logprobs])
                for r in reqs]

    on, off = run(True), run(False)
    assert on == off
    assert all(len(lps) == 6 for _, lps in on[1::2]) and all(not lps for _, lps in on[::2])


def test_step_returns_the_previous_steps_tokens_under_overlap():
    e = make_engine()
    r = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert e.step() == []  # the prefill is launched; its token is not read yet
    assert r.num_pending == 1 and r.output_ids == []
    assert e.step() == [r] and len(r.output_ids) == 1  # the first decode launched, the prefill's token read
    e.run_until_done()
    assert len(r.output_ids) == 3 and r.num_pending == 0 and e.pages_leaked() == 0


def test_launching_a_step_reads_nothing_back_from_the_device():
    """Scheduling, the runner's metadata, the table writes, sampling, recording the tokens and starting
    their copy: none of it reads tensor data on the host (on a GPU each such read would wait for the
    step before). The model and the CPU backend's own checks are outside what is checked here."""
    from host_reads import allowing, no_host_reads

    e = make_engine(chunked_prefill_size=16)
    e.runner.model = allowing(e.runner.model)
    e.runner.backend.plan = allowing(e.runner.backend.plan)
    e.parts.kv.pool.check_slots = allowing(e.parts.kv.pool.check_slots)  # CPU only, by design
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, top_k=30, seed=4, logprobs=2),
              SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.7, top_p=0.8, min_p=0.1)]
    reqs = [e.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
    launch = e._launch
    launched = []

    def guarded(in_flight):
        with no_host_reads():
            step = launch(in_flight)
        launched.append(step)
        return step

    e._launch = guarded
    e.run_until_done()
    assert len(launched) >= 7 and all(len(r.output_ids) == 6 for r in reqs)
    assert e.pages_leaked() == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_readmitted_requests_decode_their_known_last_token(overlap):
    """A preempted request recomputed in chunks can end one token short of its sequence and then decode
    in a row it never sampled into: its input must be its known last token, not that row's device entry.
    Aborts and a tiny pool with the prefix cache on make that happen; every greedy output must equal the
    same request run alone."""
    rng = random.Random(1)
    ps = prompts(60, seed=9, shared_prefix=24, lo=3, hi=12) + prompts(60, seed=10, lo=3, hi=30)
    engine = make_engine(max_total_tokens=160, max_running_requests=16, chunked_prefill_size=16,
                         disable_overlap_schedule=not overlap)
    live, done = {}, {}
    for i, p in enumerate(ps):
        params = SamplingParams(max_new_tokens=rng.randrange(8, 28), ignore_eos=True)
        live[i] = (p, params, engine.add_request(p, params), rng.random() < 1 / 3, rng.randrange(1, 6))
    while engine.has_work():
        engine.step()
        for i, (p, params, r, abort, k) in list(live.items()):
            if abort and len(r.output_ids) >= k and not r.finished:
                engine.abort(r.rid)
                del live[i]
            elif r.finished:
                done[i] = (p, params, r)
                del live[i]
    engine.drain()
    assert engine.scheduler.counters.preemptions > 0 and engine.pages_leaked() == 0
    alone = make_engine(disable_radix_cache=True)
    for i, (p, params, r) in done.items():
        ref = alone.add_request(p, params)
        alone.run_until_done()
        assert r.output_ids == ref.output_ids, f"request {i}"
