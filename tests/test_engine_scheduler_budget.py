"""The mixed-step token budget and the admission policy (schedule_policy.py), on the tiny CPU model.

The budget bounds every step that decodes while prompts wait, without changing a token of greedy
output; lpm admits the prompt with the longest cached prefix first, fcfs the oldest.
"""

from collections import deque
from dataclasses import dataclass

import pytest
from engine_helpers import make_engine, prompts
from test_engine_scheduler import baseline, greedy, run_all

from attnserve.engine.config import EngineConfig
from attnserve.engine.schedule_policy import LPM_MAX_WAITING, order_waiting, prefill_token_budget

LONG = prompts(10, seed=21, lo=40, hi=90)
BUDGET, CHUNK = 20, 64


def recorded_steps(engine) -> list:
    """Every batch the scheduler hands out from now on, with the number of prompts still waiting."""
    steps, schedule = [], engine.scheduler.schedule

    def spy(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        if batch is not None:
            steps.append((batch, len(engine.scheduler.waiting) + sum(
                r.is_prefilling for r in engine.scheduler.running)))
        return batch

    engine.scheduler.schedule = spy
    return steps


@pytest.mark.parametrize("page_size", [1, 4])
def test_no_step_that_decodes_exceeds_the_budget_and_outputs_are_unchanged(page_size):
    e = make_engine(chunked_prefill_size=CHUNK, max_num_batched_tokens=BUDGET, max_running_requests=8,
                    page_size=page_size, disable_radix_cache=True)
    steps = recorded_steps(e)
    assert run_all(e, LONG, stagger=2) == baseline(LONG, page_size)
    decoding = [(b, waiting) for b, waiting in steps if b.num_decodes]
    assert all(b.num_tokens <= BUDGET for b, _ in decoding)
    # the budget was the binding limit: decodes ran while prompts waited, and those steps were full
    assert any(waiting and b.num_tokens == BUDGET for b, waiting in decoding)
    # a step with nothing decoding still takes a whole chunk
    assert max(b.num_tokens for b, _ in steps if not b.num_decodes) > BUDGET


def test_without_the_budget_a_chunk_comes_on_top_of_the_decodes():
    e = make_engine(chunked_prefill_size=CHUNK, max_num_batched_tokens=0, max_running_requests=8,
                    disable_radix_cache=True)
    steps = recorded_steps(e)
    assert run_all(e, LONG, stagger=2) == baseline(LONG)
    assert max(b.num_tokens for b, _ in steps if b.num_decodes) > BUDGET


def test_prefill_token_budget():
    # (chunked_prefill_size, max_prefill_tokens, max_num_batched_tokens, step_tokens) -> prompt tokens
    assert prefill_token_budget(2048, 16384, 512, 0) == 2048  # nothing decodes: the whole chunk
    assert prefill_token_budget(2048, 16384, 512, 64) == 448
    assert prefill_token_budget(256, 16384, 512, 64) == 256  # the chunk is the smaller limit
    assert prefill_token_budget(2048, 16384, 512, 600) == 0  # decodes fill the step: prompts wait
    assert prefill_token_budget(2048, 16384, None, 64) == 2048  # budget off
    assert prefill_token_budget(None, 16384, 512, 64) == 16384  # no chunking: a prompt runs whole


def test_budget_default_and_checks():
    assert EngineConfig(device="cpu").max_num_batched_tokens == 512
    assert EngineConfig(device="cpu", max_running_requests=400).max_num_batched_tokens == 800
    assert EngineConfig(device="cpu", max_num_batched_tokens=0).max_num_batched_tokens == 0
    with pytest.raises(ValueError, match="max_num_batched_tokens 64 must exceed max_running_requests 64"):
        EngineConfig(device="cpu", max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(device="cpu", schedule_policy="lifo")


def _admitted_first(policy: str) -> str:
    """Cache a prompt, then queue one with no cached prefix before one that shares it: which one does
    the next step admit first?"""
    shared = prompts(1, seed=30, lo=40, hi=41)[0]
    fresh, sharing = prompts(1, seed=31, lo=30, hi=31)[0], shared + [7, 8, 9]
    e = make_engine(chunked_prefill_size=8, schedule_policy=policy, max_running_requests=4)
    run_all(e, [shared])
    steps = recorded_steps(e)
    names = {id(e.add_request(fresh, greedy())): "fresh", id(e.add_request(sharing, greedy())): "sharing"}
    e.run_until_done()
    assert e.pages_leaked() == 0
    return names[id(steps[0][0].reqs[0])]


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_the_oldest():
    assert _admitted_first("lpm") == "sharing"
    assert _admitted_first("fcfs") == "fresh"


@dataclass
class Queued:
    name: str
    arrival_time: float
    hit: int


def test_order_waiting_is_stable_and_falls_back_to_arrival_on_long_queues():
    q = deque([Queued("a", 1, 0), Queued("b", 2, 16), Queued("c", 3, 0), Queued("d", 0.5, 16)])
    order_waiting(q, "lpm", lambda r: r.hit)
    assert [r.name for r in q] == ["d", "b", "a", "c"]
    before = list(q)
    order_waiting(q, "fcfs", lambda r: r.hit)
    assert list(q) == before
    order_waiting(q, "lpm", None)  # no radix cache: nothing to rank by
    assert list(q) == before
    many = deque(Queued(str(i), -i, hit=i) for i in range(LPM_MAX_WAITING + 1))
    order_waiting(many, "lpm", lambda r: pytest.fail("a long queue is not matched against the cache"))
    assert [r.arrival_time for r in many] == sorted(r.arrival_time for r in many)
