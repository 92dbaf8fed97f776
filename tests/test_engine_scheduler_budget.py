"""The mixed-step token budget and the admission policy (schedule_policy.py), on the tiny CPU model.

The budget bounds every step that decodes while prompts wait, without changing a token of greedy
output: a fixed cap, the decode-scaled `auto` policy (fewer prompt tokens the more streams decode),
or off; unset, it resolves by device (CPU: 512, GPU: auto) in one place, which the start-up log states.
lpm admits the prompt with the longest cached prefix first, fcfs the oldest.
"""

from collections import deque
from dataclasses import dataclass

import pytest
from engine_helpers import make_engine, prompts
from test_engine_scheduler import baseline, greedy, run_all

from attnserve.engine.config import EngineConfig
from attnserve.engine.schedule_policy import (
    AUTO_MIN_PREFILL,
    AUTO_STREAM_TOKENS,
    LPM_MAX_WAITING,
    OFF,
    StepBudget,
    order_waiting,
    parse_step_budget,
    prefill_token_budget,
    resolve_step_budget,
)

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


FIXED_512 = StepBudget("fixed", 512)


def test_prefill_token_budget():
    # (chunked_prefill_size, max_prefill_tokens, step budget, step_tokens) -> prompt tokens
    assert prefill_token_budget(2048, 16384, FIXED_512, 0) == 2048  # nothing decodes: the whole chunk
    assert prefill_token_budget(2048, 16384, FIXED_512, 64) == 448
    assert prefill_token_budget(256, 16384, FIXED_512, 64) == 256  # the chunk is the smaller limit
    assert prefill_token_budget(2048, 16384, FIXED_512, 600) == 0  # decodes fill the step: prompts wait
    assert prefill_token_budget(2048, 16384, OFF, 64) == 2048  # budget off
    assert prefill_token_budget(None, 16384, FIXED_512, 64) == 16384  # no chunking: a prompt runs whole


def test_budget_default_and_checks():
    # unset stays unset in the config: the device decides at start-up
    assert EngineConfig(device="cpu").max_num_batched_tokens is None
    assert EngineConfig(device="cpu", max_num_batched_tokens=0).max_num_batched_tokens == 0
    assert EngineConfig(device="cpu", max_num_batched_tokens="1024").max_num_batched_tokens == 1024
    assert EngineConfig(device="cpu", max_num_batched_tokens="AUTO").max_num_batched_tokens == "auto"
    assert EngineConfig(device="cpu", max_num_batched_tokens="auto:4096").max_num_batched_tokens == "auto:4096"
    with pytest.raises(ValueError, match="max_num_batched_tokens 64 must exceed max_running_requests 64"):
        EngineConfig(device="cpu", max_num_batched_tokens=64)
    for bad in ("fast", "auto:0", "auto:x", True):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            EngineConfig(device="cpu", max_num_batched_tokens=bad)
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(device="cpu", schedule_policy="lifo")


def test_the_device_default_is_resolved_in_one_place():
    cpu = resolve_step_budget(None, 64, "cpu")
    assert (cpu.kind, cpu.tokens, cpu.label) == ("fixed", 512, "512")
    assert "serve-budget-cpu.json" in cpu.reason  # the measurement behind it
    assert resolve_step_budget(None, 400, "cpu").tokens == 800
    gpu = resolve_step_budget(None, 64, "cuda")
    assert (gpu.kind, gpu.tokens) == ("fixed", 2048)
    assert "GPU default" in gpu.reason and "serve-budget-h200.json" in gpu.reason
    assert resolve_step_budget(None, 2000, "cuda").tokens == 4000
    # an explicit value wins on every device
    for device in ("cpu", "cuda"):
        assert resolve_step_budget(1024, 64, device) == StepBudget("fixed", 1024, reason="--max-num-batched-tokens 1024")
        assert resolve_step_budget(-1, 64, device).kind == "off"
        assert resolve_step_budget("auto", 64, device).kind == "auto"
        assert resolve_step_budget("auto:4096", 64, device).stream_tokens == 4096
    assert parse_step_budget("auto:4096") == "auto:4096" and parse_step_budget(" 12 ") == 12


def test_the_startup_log_states_the_budget_and_its_reason():
    e = make_engine(chunked_prefill_size=CHUNK, max_running_requests=8)
    line = next(x for x in e.parts.startup_lines if x.startswith("step budget:"))
    assert "512 tokens in a step that decodes" in line and "CPU default" in line
    assert e.step_budget.label == "512" and e.stats()["step_budget"] == "512"
    e = make_engine(chunked_prefill_size=CHUNK, max_running_requests=8, max_num_batched_tokens="auto")
    line = next(x for x in e.parts.startup_lines if x.startswith("step budget:"))
    assert line.startswith(f"step budget: auto: beside D running decodes a step adds min({CHUNK}, ")
    e = make_engine(max_running_requests=8)  # chunking off: the budget has nothing to bound
    assert "no effect" in next(x for x in e.parts.startup_lines if x.startswith("step budget:"))


def test_auto_prefill_tokens_shrink_as_decodes_grow():
    b = StepBudget("auto")
    assert b.prefill_tokens(0, 8192) == 8192  # nothing decodes: the whole chunk
    assert b.prefill_tokens(1, 8192) == 8192  # the chunk caps it
    assert b.prefill_tokens(8, 8192) == 8192
    assert b.prefill_tokens(16, 8192) == 4096
    assert b.prefill_tokens(64, 8192) == AUTO_STREAM_TOKENS // 64 == 1024
    assert b.prefill_tokens(512, 8192) == AUTO_MIN_PREFILL  # the floor: fewer tokens would not shorten the step
    got = [b.prefill_tokens(d, 8192) for d in range(1, 600)]
    assert got == sorted(got, reverse=True)  # never more prompt tokens for more decodes
    # D x P stays within S wherever the floor and the chunk do not decide
    assert all(d * p <= AUTO_STREAM_TOKENS for d, p in zip(range(1, 600), got) if AUTO_MIN_PREFILL < p < 8192)
    assert StepBudget("fixed", 512).prefill_tokens(64, 8192) == 448
    assert StepBudget("off").prefill_tokens(64, 8192) == 8192
    assert prefill_token_budget(8192, 16384, StepBudget("auto"), 64) == 1024
    assert prefill_token_budget(None, 16384, StepBudget("auto"), 64) == 16384  # no chunking: a prompt runs whole
    with pytest.raises(ValueError):
        StepBudget("fixed", 0)
    with pytest.raises(ValueError):
        StepBudget("sometimes")


AUTO_SMALL = StepBudget("auto", stream_tokens=96, min_prefill=4)  # the policy at the tiny model's scale


@pytest.mark.parametrize("page_size", [1, 4])
def test_auto_gives_each_mixed_step_its_share_and_outputs_are_unchanged(page_size):
    e = make_engine(chunked_prefill_size=CHUNK, max_running_requests=8, page_size=page_size,
                    disable_radix_cache=True)
    e.scheduler.config.step_budget = AUTO_SMALL
    steps = recorded_steps(e)
    assert run_all(e, LONG, stagger=2) == baseline(LONG, page_size)
    decoding = [(b, waiting) for b, waiting in steps if b.num_decodes]
    for b, _ in decoding:
        assert b.num_tokens - b.num_decodes <= AUTO_SMALL.prefill_tokens(b.num_decodes, CHUNK)
    # the policy was the binding limit at several batch sizes: a prompt still waiting got exactly its share
    bound = {b.num_decodes for b, waiting in decoding
             if waiting > 1 and b.num_tokens - b.num_decodes == AUTO_SMALL.prefill_tokens(b.num_decodes, CHUNK)}
    assert len(bound) >= 2
    # more decodes, fewer prompt tokens: a one-decode step took more than any step of 6 or more decodes
    few = max(b.num_tokens - b.num_decodes for b, _ in decoding if b.num_decodes == 1)
    many = max((b.num_tokens - b.num_decodes for b, _ in decoding if b.num_decodes >= 6), default=0)
    assert few > many


def test_set_step_budget_swaps_the_policy_of_an_idle_engine():
    e = make_engine(chunked_prefill_size=CHUNK, max_running_requests=8, disable_radix_cache=True)
    assert e.set_step_budget(0).kind == "off"
    assert e.set_step_budget("auto:96").stream_tokens == 96
    assert e.set_step_budget(None).label == "512"  # the device default again
    with pytest.raises(ValueError, match="must exceed max_running_requests"):
        e.set_step_budget(8)
    e.add_request(LONG[0], greedy())
    with pytest.raises(RuntimeError, match="idle"):
        e.set_step_budget(1024)
    e.run_until_done()
    assert e.set_step_budget(BUDGET).tokens == BUDGET
    steps = recorded_steps(e)
    assert run_all(e, LONG, stagger=2) == baseline(LONG)
    assert all(b.num_tokens <= BUDGET for b, _ in steps if b.num_decodes)


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
