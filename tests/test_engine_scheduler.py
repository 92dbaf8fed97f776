"""Engine correctness on the CPU: greedy output must not depend on how requests were batched.

Every test compares against requests run one at a time with the radix cache
off, and ends with a leak check: with nothing running, every page is free or
held by the prefix cache alone.
"""

import pytest
from engine_helpers import make_engine, prompts

from attnserve.engine.request import FinishReason
from attnserve.engine.sampling_params import SamplingParams

NEW = 12
_BASELINE: dict = {}


def greedy(n=NEW):
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def run_all(engine, ps, params=None, stagger=0):
    """Submit `ps` (all at once, or `stagger` per step), run to completion, return outputs in order."""
    reqs, pending = [], list(ps)
    while pending or engine.has_work():
        take = len(pending) if stagger == 0 else stagger
        for p in pending[:take]:
            reqs.append(engine.add_request(p, params or greedy()))
        pending = pending[take:]
        engine.step()
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert engine.pages_leaked() == 0
    return [r.output_ids for r in reqs]


def baseline(ps, page_size=1):
    key = (tuple(map(tuple, ps)), page_size)
    if key not in _BASELINE:
        out = []
        for p in ps:
            e = make_engine(disable_radix_cache=True, page_size=page_size)
            out += run_all(e, [p])
        _BASELINE[key] = out
    return _BASELINE[key]


PROMPTS = prompts(16, seed=1, shared_prefix=0)
SHARED = prompts(8, seed=2, shared_prefix=24, lo=3, hi=12)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_batched_staggered_matches_one_at_a_time(page_size):
    e = make_engine(page_size=page_size, disable_radix_cache=True)
    got = run_all(e, PROMPTS, stagger=3)
    assert got == baseline(PROMPTS, page_size)
    assert e.scheduler.counters.mixed_steps > 0  # prefills joined running decodes


@pytest.mark.parametrize("page_size", [1, 4])
def test_b_radix_cache_hits_and_keeps_output(page_size):
    e = make_engine(page_size=page_size)
    first = run_all(e, SHARED, stagger=2)
    hits_first = e.cache_stats()["hit_tokens"]
    assert hits_first > 0  # the shared 24-token prefix is reused by later arrivals
    second = run_all(e, SHARED)
    assert first == second == baseline(SHARED, page_size)
    stats = e.cache_stats()
    # the second run finds every prompt cached except its last (recomputed) token, page aligned
    assert stats["hit_tokens"] - hits_first >= sum((len(p) - page_size) for p in SHARED)
    e.flush_cache()
    assert e.scheduler.allocator.num_free == e.scheduler.allocator.total


def test_b_fully_cached_prompt_recomputes_last_token():
    e = make_engine()
    p = SHARED[0]
    out1 = run_all(e, [p])
    req = e.add_request(p, greedy())
    e.step()
    assert req.cached_len == len(p) - 1
    e.run_until_done()
    assert [req.output_ids] == out1


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_c_chunked_prefill_matches(chunk):
    long_prompts = prompts(6, seed=3, lo=30, hi=90)
    e = make_engine(chunked_prefill_size=chunk, disable_radix_cache=True)
    assert run_all(e, long_prompts, stagger=2) == baseline(long_prompts)


@pytest.mark.parametrize("chunk", [6, 8])
def test_c_chunked_prefill_with_radix_and_pages(chunk):
    long_prompts = prompts(6, seed=3, lo=30, hi=90)
    e = make_engine(chunked_prefill_size=chunk, page_size=4)
    assert run_all(e, long_prompts, stagger=2) == baseline(long_prompts, 4)


@pytest.mark.parametrize("page_size,radix", [(1, False), (1, True), (4, True)])
def test_d_preemption_under_a_tiny_pool(page_size, radix):
    # 16 requests of up to 40 + 12 tokens into a pool of 160 tokens: decodes must preempt
    e = make_engine(max_total_tokens=160, page_size=page_size, disable_radix_cache=not radix,
                    chunked_prefill_size=32)
    got = run_all(e, PROMPTS)
    assert e.scheduler.counters.preemptions > 0
    assert got == baseline(PROMPTS, page_size)


def test_abort_mid_generation_frees_pages():
    e = make_engine(disable_radix_cache=True)
    reqs = [e.add_request(p, greedy(50)) for p in PROMPTS[:4]]
    for _ in range(5):
        e.step()
    assert len(reqs[1].output_ids) > 0 and reqs[1].pages
    used_before = e.scheduler.allocator.num_used
    held = len(reqs[1].pages)
    assert e.abort(reqs[1].rid)
    assert reqs[1].finish_reason is FinishReason.ABORT
    assert e.scheduler.allocator.num_used == used_before - held
    assert not e.abort(reqs[1].rid)  # already gone
    # a waiting request aborts too
    late = e.add_request(PROMPTS[5], greedy())
    assert e.abort(late.rid) and late.finish_reason is FinishReason.ABORT
    e.run_until_done()
    assert e.pages_leaked() == 0
    assert e.scheduler.allocator.num_free == e.scheduler.allocator.total


def test_request_too_large_for_pool_is_rejected():
    e = make_engine(max_total_tokens=32)
    with pytest.raises(ValueError, match="pool"):
        e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="no tokens"):
        e.add_request([], greedy())


def test_stop_token_and_max_tokens():
    e = make_engine()
    ref = run_all(e, [PROMPTS[0]])[0]
    stop_at = ref[3]
    first = ref.index(stop_at)
    req = e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop_at]))
    e.run_until_done()
    assert req.finish_reason is FinishReason.STOP and req.output_ids == ref[: first + 1]
    assert req.matched_stop == stop_at


@pytest.mark.parametrize("field,value", [("device", "tpu"), ("max_running_requests", 0), ("max_total_tokens", 0),
                                         ("mem_fraction_static", 1.5), ("cuda_graph_max_bs", 0),
                                         ("max_context_len", 1)])
def test_engine_config_names_bad_field(field, value):
    from attnserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_chunk_smaller_than_page_is_rejected():
    from attnserve.engine.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match="chunked_prefill_size"):
        SchedulerConfig(page_size=16, chunked_prefill_size=8)


def test_soak_random_arrivals_aborts_preemption_cache_and_chunks():
    import random

    rng = random.Random(11)
    ps = prompts(14, seed=12, shared_prefix=10, lo=2, hi=50)
    ref = baseline(ps, 4)
    e = make_engine(max_total_tokens=96, page_size=4, chunked_prefill_size=6)
    pending = list(enumerate(ps))
    reqs: dict[int, object] = {}
    doomed = {2, 7, 11}
    while pending or e.has_work():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                i, p = pending.pop(0)
                reqs[i] = e.add_request(p, greedy())
        for i in sorted(doomed):  # a copy: aborting removes from the set
            if i in reqs and rng.random() < 0.3:
                e.abort(reqs[i].rid)
                doomed.discard(i)
        e.step()
        e.scheduler.allocator.check_leaks()
    assert e.scheduler.counters.preemptions > 0
    for i, r in reqs.items():
        if r.finish_reason is FinishReason.ABORT:
            assert i in {2, 7, 11}
        else:
            assert r.output_ids == ref[i]
    assert e.pages_leaked() == 0


def test_unchunked_long_prompt_joins_running_decodes():
    # without chunking a prompt longer than max_prefill_tokens still runs whole, beside the decodes
    e = make_engine(chunked_prefill_size=None, max_prefill_tokens=16)
    short = e.add_request(PROMPTS[0][:5], greedy(20))
    e.step()
    e.step()
    long_prompt = prompts(1, seed=40, lo=40, hi=41)[0]
    late = e.add_request(long_prompt, greedy())
    before = short.num_generated  # with overlap, the latest token may still be on its way to the host
    e.step()
    assert late.kv_len == len(long_prompt) and late.num_generated == 1
    assert short.num_generated == before + 1
    e.run_until_done()
    assert e.pages_leaked() == 0
