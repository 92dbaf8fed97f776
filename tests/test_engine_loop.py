"""EngineLoop: requests from several threads, streamed back; aborts from another thread free pages;
bad requests fail alone and never end the loop; a soak of mixed traffic leaks nothing."""

import random
import threading

import pytest
from engine_helpers import VOCAB, make_engine, prompts

from attnserve.engine.loop import EngineLoop
from attnserve.engine.outputs import RequestFailed
from attnserve.engine.request import Request
from attnserve.engine.sampling_params import SamplingParams

PROMPTS = prompts(6, seed=31)
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)
WAIT = 60.0  # seconds: a lost request fails the test instead of hanging it


def _join_all(threads):
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a client thread is still waiting for its request"


_REFERENCE = []


def _alone(prompt, params):
    """The request run by itself (one engine reused: with the prefix cache off, each run starts clean)."""
    if not _REFERENCE:
        _REFERENCE.append(make_engine(disable_radix_cache=True))
    e = _REFERENCE[0]
    r = e.add_request(prompt, params)
    e.run_until_done()
    return r.output_ids


def test_threads_get_the_same_tokens_as_one_at_a_time():
    ref = [_alone(p, PARAMS) for p in PROMPTS]
    loop = EngineLoop(make_engine()).start()
    results = [None] * len(PROMPTS)

    def client(i):
        h = loop.submit(PROMPTS[i], PARAMS)
        streamed = []
        for ev in h.events(WAIT):
            streamed += ev.token_ids
            last = ev
        assert last.finished and last.output.token_ids == streamed
        results[i] = streamed

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    _join_all(threads)
    loop.stop()
    assert results == ref
    assert loop.error is None and loop.engine.pages_leaked() == 0


def test_abort_from_another_thread_and_bad_input():
    loop = EngineLoop(make_engine(disable_radix_cache=True)).start()
    h = loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=500, ignore_eos=True))
    first = next(h.events(WAIT))  # generating now
    assert first.token_ids
    loop.abort(h.rid)
    rest = list(h.events(WAIT))  # ends without a finished output
    assert not any(ev.finished for ev in rest)
    with pytest.raises(ValueError, match="no tokens"):  # refused by the submitting thread, before queueing
        loop.submit([], PARAMS)
    assert loop.submit(PROMPTS[1], PARAMS).result(WAIT).finish_reason == "length"  # and the loop goes on
    loop.stop()
    assert loop.engine.scheduler.allocator.num_free == loop.engine.scheduler.allocator.total


# ---- bad requests -------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, name", [
    ({"stop_token_ids": None}, None),  # None means no stop tokens: accepted
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop": [3]}, "stop"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_sampling_params_name_the_bad_field(fields, name):
    if name is None:
        assert SamplingParams(**fields).stop_token_ids == ()
        return
    with pytest.raises(ValueError, match=f"SamplingParams.{name}="):
        SamplingParams(**fields)


def test_params_cannot_change_after_construction():
    p = SamplingParams(max_new_tokens=4)
    with pytest.raises(AttributeError):
        p.stop_token_ids = None
    with pytest.raises(AttributeError):
        p.temperature = float("nan")


def test_extreme_but_valid_params_run_and_the_loop_survives():
    """Values that used to overflow inside a step: seed at 2**64 - 1, top_k past the vocabulary,
    a temperature so small that logits / temperature overflows (greedy below GREEDY_TEMPERATURE)."""
    loop = EngineLoop(make_engine()).start()
    greedy = loop.submit(PROMPTS[0], PARAMS).result(WAIT).token_ids
    cases = [
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=2**64 - 1),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, top_k=10**20),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1e-38),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=2**64 - 1, n=1,
                       top_p=1e-9, logprobs=20),
    ]
    outs = [loop.submit(PROMPTS[0], p).result(WAIT) for p in cases]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)
    assert all(0 <= t < VOCAB for o in outs for t in o.token_ids)
    assert outs[2].token_ids == greedy  # a vanishing temperature is greedy, not NaN -> token 0
    assert outs[3].token_ids == greedy  # top_p this small keeps only the most likely token
    assert len(outs[3].logprobs) == 10 and all(len(lp.top) == 20 for lp in outs[3].logprobs)
    with pytest.raises(ValueError, match="stop_token_ids"):  # the engine's own bound: the vocabulary
        loop.submit(PROMPTS[0], SamplingParams(stop_token_ids=[VOCAB]))
    loop.stop()
    assert loop.error is None and loop.engine.pages_leaked() == 0


def test_a_request_failing_inside_a_step_fails_alone():
    engine = make_engine()
    real_sample = engine.sampler.sample

    def sample(logits, rids, params):  # the sampler fails on one request's row (a per-request fault)
        if any(p.seed == 666 for p in params):
            raise RuntimeError("bad row")
        return real_sample(logits, rids, params)

    engine.sampler.sample = sample
    loop = EngineLoop(engine).start()
    bad = loop.submit(PROMPTS[1], SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=666))
    good = [loop.submit(p, PARAMS) for p in PROMPTS[2:5]]
    with pytest.raises(RequestFailed, match="bad row"):
        bad.result(WAIT)
    assert [g.result(WAIT).token_ids for g in good] == [_alone(p, PARAMS) for p in PROMPTS[2:5]]
    assert loop.alive and loop.error is None
    loop.stop()
    assert loop.engine.pages_leaked() == 0


def test_a_failing_add_reaches_its_submitter_even_for_a_base_exception():
    engine = make_engine()
    real_add = engine.add

    def add(req):
        if req.prompt_ids[0] == 7:
            raise KeyboardInterrupt  # not an Exception: used to strand its submitter
        return real_add(req)

    engine.add = add
    loop = EngineLoop(engine).start()
    h = loop.submit([7, 1, 2], PARAMS)
    with pytest.raises(KeyboardInterrupt):
        h.result(WAIT)
    loop._thread.join(WAIT)
    assert isinstance(loop.error, KeyboardInterrupt)  # a BaseException still ends the loop, loudly
    with pytest.raises(RuntimeError, match="failed"):
        loop.submit([1], PARAMS)


# ---- a dead loop --------------------------------------------------------------------------------
class _FailingEngine:
    """Accepts requests; its step raises once `fail` is set (the model failing mid-batch)."""

    tokenizer = None

    def __init__(self):
        self.pending: list[int] = []
        self.in_step = threading.Event()
        self.fail = threading.Event()

    def make_request(self, prompt, params, rid):
        return Request(rid=rid, prompt_ids=list(prompt), params=params or SamplingParams())

    def add(self, req):
        self.pending.append(req.rid)

    def has_work(self):
        return bool(self.pending)

    def step(self):
        self.in_step.set()
        self.fail.wait(10)
        raise RuntimeError("model exploded")

    def abort(self, rid):
        return None


def _result_within(handle, seconds=10.0):
    """handle.result() in a thread: returns ('ok', value) or ('error', exc); fails the test if it hangs."""
    box = []

    def wait():
        try:
            box.append(("ok", handle.result()))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box.append(("error", exc))

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "result() is still blocked after the engine loop died"
    return box[0]


def test_dead_loop_wakes_waiters_and_refuses_new_work():
    engine = _FailingEngine()
    loop = EngineLoop(engine).start()
    running = loop.submit([1, 2, 3], PARAMS)
    assert engine.in_step.wait(10)
    queued = loop.submit([4, 5], PARAMS)  # submitted while the failing step runs: never picked up
    engine.fail.set()
    for handle in (running, queued):
        kind, exc = _result_within(handle)
        assert kind == "error" and "model exploded" in str(exc)
    loop._thread.join(10)
    assert isinstance(loop.error, RuntimeError) and not loop.alive
    with pytest.raises(RuntimeError, match="model exploded"):
        loop.submit([6], PARAMS)
    loop.stop()


# ---- the soak -----------------------------------------------------------------------------------
def test_soak_mixed_traffic_threads_aborts_preemption_invalid_requests():
    """Many requests from several threads on a pool small enough to force preemption, shared prefixes,
    aborts at random moments and invalid requests mixed in: only the invalid ones error (clearly), no
    page leaks, and every greedy request that ran to its end equals the same request run alone."""
    rng = random.Random(5)
    shared = prompts(60, seed=9, shared_prefix=24, lo=3, hi=12) + prompts(60, seed=10, lo=3, hi=30)
    engine = make_engine(max_total_tokens=160, max_running_requests=16, chunked_prefill_size=16)
    loop = EngineLoop(engine).start()
    jobs = []
    for i, p in enumerate(shared):
        kind = rng.choice(["greedy", "greedy", "sampled", "abort", "invalid"])
        jobs.append((i, p, kind, rng.randrange(8, 28)))
    results: dict[int, object] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def client(my_jobs):
        for i, prompt, kind, n in my_jobs:
            try:
                if kind == "invalid":
                    bad = [VOCAB + 5] if i % 2 else []
                    with pytest.raises(ValueError):
                        loop.submit(bad or prompt, SamplingParams(max_new_tokens=n) if bad else
                                    SamplingParams(max_new_tokens=n, stop_token_ids=[VOCAB]))
                    continue
                params = SamplingParams(max_new_tokens=n, ignore_eos=True,
                                        temperature=0.0 if kind != "sampled" else 0.8, seed=i)
                h = loop.submit(prompt, params)
                if kind == "abort":
                    for k, _ in enumerate(h.events(WAIT)):
                        if k >= i % 3:
                            loop.abort(h.rid)
                    continue
                out = h.result(WAIT)
                with lock:
                    results[i] = (kind, params, out)
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                with lock:
                    errors.append(f"job {i} ({kind}): {exc!r}")

    threads = [threading.Thread(target=client, args=(jobs[k::16],)) for k in range(16)]
    for t in threads:
        t.start()
    _join_all(threads)
    assert errors == []
    # the loop is idle now: every page is free or held by the prefix cache alone
    assert loop.query(lambda e: e.pages_leaked()) == 0
    assert loop.query(lambda e: e.scheduler.counters.preemptions) > 0, "the pool never forced a preemption"
    loop.stop()
    assert loop.error is None
    for i, (kind, params, out) in results.items():
        assert len(out.token_ids) == params.max_new_tokens
        if kind == "greedy":
            assert out.token_ids == _alone(shared[i], params), f"job {i}"
    assert len(results) == sum(kind in ("greedy", "sampled") for _, _, kind, _ in jobs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_stop_with_requests_in_flight_leaves_the_engine_idle_and_reusable(overlap):
    engine = make_engine(disable_overlap_schedule=not overlap)
    loop = EngineLoop(engine).start()
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    decoding = [loop.submit(p, long) for p in PROMPTS[:3]]
    events = [decoding[0].events(WAIT)]
    next(events[0])  # the first is decoding (a step is in flight with overlap)
    queued = [loop.submit(p, long) for p in PROMPTS[3:]]
    loop.stop()
    assert not loop._thread.is_alive()
    assert not engine.has_work() and engine._in_flight is None
    assert engine.pages_leaked() == 0 and engine.state()["kv_cache"]["pages_in_use"] == 0
    for h in decoding + queued:
        out = h.result(WAIT)  # every handle ended, none hangs
        assert out is not None and out.finish_reason == "abort" and len(out.token_ids) < 200
    assert decoding[0].stream.output.token_ids  # the tokens it had are kept
    again = EngineLoop(engine).start()  # the engine is reusable
    assert again.submit(PROMPTS[0], PARAMS).result(WAIT).token_ids == _alone(PROMPTS[0], PARAMS)
    again.stop()
    assert engine.pages_leaked() == 0 and not engine.has_work()
