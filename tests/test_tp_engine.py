"""Tensor parallelism on the CPU (gloo): the engine at tp > 1 gives what it gives at tp 1.

Each tp size loads the same checkpoint from disk (every rank reads its own slice) and runs one
scenario that exercises the scheduler's hard cases at once: a pool small enough to preempt,
chunked prefill mixed with decodes, shared prefixes served by the radix cache, and an abort.
The scheduler and its page bookkeeping live on rank 0 alone (the other ranks hold no pages,
only their heads' share of each slot rank 0 hands out), so its leak check covers every rank.
"""

from __future__ import annotations

import math

import pytest
from engine_helpers import prompts
from tp_helpers import TINY_DEEPSEEK_TP, TINY_LLAMA_TP, write_checkpoint

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

PROMPTS = prompts(6, seed=5, shared_prefix=10, lo=4, hi=24)
LATE = prompts(2, seed=6, lo=4, hi=12)
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=5)


def _engine(path, tp: int, **kw) -> Engine:
    # fp32: tp ranks sum partial products in another order, which only fp32 keeps within the 1e-4 below
    settings = {"model": str(path), "device": "cpu", "dtype": "fp32", "attention_backend": "torch_native",
                "tp_size": tp, "page_size": 4, "max_total_tokens": 96, "chunked_prefill_size": 16, "max_running_requests": 8, **kw}
    return Engine(EngineConfig(**settings))


def scenario(engine: Engine) -> dict:
    """Greedy outputs (ids and top logprobs) of a mixed, preempting, prefix-sharing run with an abort."""
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    victim = engine.add_request(PROMPTS[0] + [7, 7, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    reqs += [engine.add_request(PROMPTS[1][:12] + p, GREEDY) for p in LATE]  # arrive mid-run; share a prefix
    engine.step()
    assert engine.abort(victim.rid)
    engine.run_until_done()
    stats = engine.stats()
    return {"ids": [r.output_ids for r in reqs],
            "logprobs": [[[lp for _, lp in t.top] for t in r.output_logprobs] for r in reqs],
            "leaked": engine.pages_leaked(), "preemptions": stats["preemptions"], "mixed": stats["mixed_steps"],
            "hits": stats["cache"]["hit_tokens"], "aborted": stats["aborted"]}


def _close(a: list, b: list, tol: float = 1e-4) -> bool:
    return all(math.isclose(x, y, abs_tol=tol) for ra, rb in zip(a, b) for ta, tb in zip(ra, rb)
               for x, y in zip(ta, tb))


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return write_checkpoint(TINY_LLAMA_TP, tmp_path_factory.mktemp("tiny-llama-tp"), seed=4)


@pytest.fixture(scope="module")
def llama_tp1(llama_path):
    e = _engine(llama_path, 1)
    return scenario(e)


@pytest.mark.parametrize(("tp", "overlap"), [(2, True), (4, True), (2, False)])
def test_tiny_llama_at_tp_matches_tp1(llama_path, llama_tp1, tp, overlap):
    """With overlap scheduling the next decode reads its token on the device: rank 0 broadcasts it there."""
    e = _engine(llama_path, tp, disable_overlap_schedule=not overlap)
    try:
        assert e.parts.model.module.kv_cache_spec().num_kv_heads == max(1, 2 // tp)  # this rank's KV heads
        got = scenario(e)
    finally:
        e.close()
    ref = llama_tp1
    assert got["ids"] == ref["ids"]
    assert _close(got["logprobs"], ref["logprobs"])
    assert got["leaked"] == 0
    # the scenario really took the hard paths, at tp 1 and here alike
    assert got["preemptions"] > 0 and got["mixed"] > 0 and got["hits"] > 0 and got["aborted"] == 1
    if overlap:  # the reference schedules with overlap too: the same steps, step for step
        assert (got["preemptions"], got["mixed"], got["hits"]) == (ref["preemptions"], ref["mixed"], ref["hits"])


def test_tiny_deepseek_mla_moe_at_tp2_matches_tp1(tmp_path):
    path = write_checkpoint(TINY_DEEPSEEK_TP, tmp_path / "tiny-deepseek", seed=2)
    ref = scenario(_engine(path, 1))
    e = _engine(path, 2)
    try:
        spec = e.parts.model.module.kv_cache_spec()
        assert spec.is_mla and spec.num_kv_heads == 1 and spec.num_q_heads == 2  # heads split, latent whole
        got = scenario(e)
    finally:
        e.close()
    assert got["ids"] == ref["ids"]
    assert _close(got["logprobs"], ref["logprobs"])
    assert got["leaked"] == 0 and got["preemptions"] > 0


def test_tp1_through_a_world_of_one_rank_matches_plain_tp1(llama_path, llama_tp1):
    """tp 1 with an init address runs the tensor-parallel path (process group, step broadcast, collectives)."""
    from attnserve.distributed.launch import free_local_addr
    from attnserve.distributed.state import parallel_state

    e = _engine(llama_path, 1, dist_init_addr=free_local_addr())
    try:
        assert parallel_state().active and parallel_state().size == 1
        got = scenario(e)
    finally:
        e.close()
    assert not parallel_state().active
    assert got["ids"] == llama_tp1["ids"] and _close(got["logprobs"], llama_tp1["logprobs"], tol=1e-6)
