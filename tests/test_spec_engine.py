"""Speculative decoding in the engine: the n-gram drafter with real acceptance, exact counters,
per-request opt-out, a soak with aborts and preemption, the triton backend, and the knobs."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import VOCAB, make_engine, prompts, tiny_model
from spec_helpers import OracleDrafter
from test_engine_models import CONFIGS

from attnserve.choice.registry import backend_for_pool
from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def _greedy(engine, ps, params=GREEDY, **kw):
    reqs = [engine.add_request(p, params, **kw) for p in ps]
    engine.run_until_done()
    assert engine.pages_leaked() == 0
    return reqs


# ---- the n-gram drafter on text that repeats ---------------------------------------------------------
# A sliding-window model (window 7, 2 layers) continues any text by its last 13 tokens only, so a prompt
# that ends with a stretch it already contains, followed there by the model's own continuation, is
# continued exactly as before: prompt lookup finds right drafts, as on input-grounded work.
@pytest.fixture(scope="module")
def window_model():
    return tiny_model(CONFIGS["mistral-sliding-window"], seed=3)


def _window_engine(bundle, **kw):
    cfg = {"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 2048,
           "chunked_prefill_size": None, **kw}
    return Engine(EngineConfig(**cfg), loaded=bundle)


def _repeating_prompts(bundle) -> list[list[int]]:
    starts = prompts(3, seed=8, lo=16, hi=20)
    cont = [r.output_ids for r in _greedy(_window_engine(bundle), starts, SamplingParams(max_new_tokens=30,
                                                                                         ignore_eos=True))]
    return [a + c + a for a, c in zip(starts, cont)]


@pytest.mark.parametrize(("topk", "page_size"), [(1, 1), (3, 16)])
def test_ngram_drafts_are_accepted_and_greedy_is_unchanged(window_model, topk, page_size):
    ps = _repeating_prompts(window_model)
    ref = [r.output_ids for r in _greedy(_window_engine(window_model, page_size=page_size), ps)]
    e = _window_engine(window_model, page_size=page_size, speculative_algorithm="ngram",
                       speculative_num_draft_tokens=5, speculative_eagle_topk=topk)
    got = _greedy(e, ps)
    assert [r.output_ids for r in got] == ref
    st = e.stats()["speculative"]
    assert st["acceptance_rate"] > 0.5
    assert all(r.spec_accepted_tokens > 0 for r in got)
    assert sum(r.spec_verify_steps for r in got) == st["verified_requests"]
    assert e.stats()["steps"] < 3 + len(ps) * GREEDY.max_new_tokens // 2  # fewer steps than one token each


# ---- exact counters ------------------------------------------------------------------------------------
def test_counters_exact_when_drafts_are_known_right_or_wrong():
    p = prompts(1, seed=4)[0]
    params = SamplingParams(max_new_tokens=11, ignore_eos=True)
    ref = _greedy(make_engine(), [p], params)[0].output_ids
    right = make_engine(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    right.drafter = OracleDrafter({tuple(p): ref}, 4, wrong_every=10**9)
    r = _greedy(right, [p], params)[0]
    # the prefill gives token 1; each verify accepts its 4 drafts and adds a bonus: 1 + 5 + 5 = 11
    assert r.output_ids == ref
    assert (r.spec_verify_steps, r.spec_draft_tokens, r.spec_accepted_tokens) == (2, 8, 8)
    st = right.stats()["speculative"]
    assert (st["verify_steps"], st["accepted_tokens"], st["acceptance_rate"]) == (2, 8, 1.0)
    assert st["accept_length_histogram"] == {4: 2}

    wrong = make_engine(speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    wrong.drafter = OracleDrafter({tuple(p): [(t + 1) % VOCAB for t in ref]}, 4, wrong_every=10**9)
    r = _greedy(wrong, [p], params)[0]
    assert r.output_ids == ref
    # one token per verify; the oracle proposes what is left of the 11, so 4 drafts 7 times, then 3, 2, 1
    assert (r.spec_verify_steps, r.spec_draft_tokens, r.spec_accepted_tokens) == (10, 34, 0)
    assert wrong.stats()["speculative"]["emitted_tokens"] == 10


def test_drafter_gives_up_on_requests_whose_drafts_keep_failing():
    from attnserve.engine.speculative.ngram import FIRST_BACKOFF, NgramDrafter

    class Req:
        rid, prompt_ids, output_ids = 0, [1, 2, 3, 1, 2], []

    d = NgramDrafter(4, 4)
    tree = d.propose(Req)
    assert tree.tokens == (3, 1, 2)
    d.observe(Req, tree, 3)
    d.observe(Req, tree, 0)  # one miss after a good step: the mean (1.5) still pays
    assert d.propose(Req) is not None
    d.observe(Req, tree, 0)  # the mean falls below one accepted draft a step: it stops proposing
    assert [d.propose(Req) for _ in range(FIRST_BACKOFF)] == [None] * FIRST_BACKOFF
    assert d.propose(Req) is not None  # tries again after the back-off
    d.observe(Req, tree, 0)  # and misses: twice as long now
    assert [d.propose(Req) for _ in range(2 * FIRST_BACKOFF)] == [None] * (2 * FIRST_BACKOFF)
    d.observe(Req, d.propose(Req), 4)  # accepted drafts bring it back
    assert d.propose(Req) is not None
    d.forget(0)
    assert d._state == {}


def test_opted_out_requests_decode_alone_in_a_speculating_batch():
    ps = prompts(4, seed=9)
    ref = [r.output_ids for r in _greedy(make_engine(), ps)]
    e = make_engine(speculative_algorithm="ngram")
    e.drafter = OracleDrafter({tuple(p): o for p, o in zip(ps, ref)}, 4)
    reqs = [e.add_request(p, GREEDY, speculative=i % 2 == 0) for i, p in enumerate(ps)]
    e.run_until_done()
    assert [r.output_ids for r in reqs] == ref
    assert all((r.spec_verify_steps > 0) == r.speculative for r in reqs)
    assert all(r.spec_draft_tokens == 0 for r in reqs if not r.speculative)


# ---- soak: a small pool, chunked prefill, preemption, aborts, stop tokens ---------------------------------
def test_soak_with_aborts_and_preemption_leaks_nothing():
    rng = random.Random(2)
    ps = prompts(12, seed=12, shared_prefix=8, lo=4, hi=30)
    params = [SamplingParams(max_new_tokens=rng.randrange(4, 30), ignore_eos=True) for _ in ps]
    refs = _outputs(ps, params)
    e = make_engine(page_size=4, max_total_tokens=80, chunked_prefill_size=16, speculative_algorithm="ngram",
                    speculative_num_draft_tokens=4, speculative_eagle_topk=2)
    e.drafter = OracleDrafter({tuple(p): o for p, o in zip(ps, refs)}, 4, tree=True)
    reqs, aborted = [], set()
    pending = list(zip(ps, params))
    steps = 0
    while pending or e.has_work():
        if pending:
            p, sp = pending.pop(0)
            reqs.append(e.add_request(p, sp))
        e.step()
        steps += 1
        if steps % 7 == 0:
            live = [r for r in reqs if not r.finished]
            if live:
                victim = rng.choice(live)
                assert e.abort(victim.rid)
                aborted.add(victim.rid)
    st = e.stats()
    assert st["preemptions"] > 0 and st["speculative"]["accepted_tokens"] > 0 and aborted
    for r, want in zip(reqs, refs):
        if r.rid in aborted:
            assert r.output_ids == want[: len(r.output_ids)]
        else:
            assert r.output_ids == want
    assert e.pages_leaked() == 0
    assert e.state()["kv_cache"]["pages_in_use"] == 0


def _outputs(ps, params):
    e = make_engine(disable_radix_cache=True)
    reqs = [e.add_request(p, sp) for p, sp in zip(ps, params)]
    e.run_until_done()
    return [r.output_ids for r in reqs]


# ---- triton (interpreted on the CPU) ---------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU engine under the Triton interpreter; on a GPU "
                    "tests/test_spec_verify_graph.py runs triton's verify steps")
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_triton_verify_keeps_greedy(tree):
    ps = prompts(2, seed=14, lo=4, hi=10)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = [r.output_ids for r in _greedy(make_engine(), ps, params)]
    e = make_engine(page_size=4, speculative_algorithm="ngram", speculative_num_draft_tokens=3,
                    speculative_eagle_topk=2 if tree else 1)
    e.runner.backend = backend_for_pool("triton", e.parts.kv.pool)
    e.drafter = OracleDrafter({tuple(p): o for p, o in zip(ps, ref)}, 3, tree=tree)
    got = _greedy(e, ps, params)
    assert [r.output_ids for r in got] == ref
    assert e.stats()["speculative"]["accepted_tokens"] > 0


# ---- knobs ------------------------------------------------------------------------------------------------
def test_knobs_validate_and_name_the_problem():
    assert EngineConfig(speculative_algorithm="NGRAM").speculative_algorithm == "ngram"
    assert EngineConfig(speculative_algorithm="none").speculative_topk == 0
    with pytest.raises(ValueError, match="ngram"):
        EngineConfig(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="max_match_window"):
        EngineConfig(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=3)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        EngineConfig(speculative_num_draft_tokens=0)


def test_selection_refuses_a_backend_that_cannot_verify_trees():
    """The engine hands the draft tree's branching to the selection (here for a hypothetical H100 serving
    an MLA model, where FlashInfer's MLA wrapper has no custom masks); a chain passes."""
    from attnserve.engine.startup import _select
    from attnserve.hardware import PRESET_HARDWARE
    from attnserve.shape import AttentionShape

    mla = AttentionShape(num_layers=61, num_q_heads=128, num_kv_heads=1, head_dim=576, v_head_dim=512,
                         attention_type="MLA", kv_lora_rank=512, qk_rope_head_dim=64, model_type="deepseek_v3")
    tree = EngineConfig(attention_backend="flashinfer", speculative_algorithm="ngram", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="no custom masks for tree speculative decoding"):
        _select(tree, mla, "bf16", PRESET_HARDWARE["h100"])
    chain = EngineConfig(attention_backend="flashinfer", speculative_algorithm="ngram")
    assert _select(chain, mla, "bf16", PRESET_HARDWARE["h100"]).decode_backend == "flashinfer"


def test_startup_log_names_the_verify_backend():
    e = make_engine(speculative_algorithm="ngram", speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    line = next(x for x in e.parts.startup_lines if x.startswith("speculative decoding:"))
    assert "ngram" in line and "tree of up to 6" in line and "verify on torch_native" in line
    assert not e.stats()["overlap_schedule"]
    assert "speculative" not in make_engine().stats()


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    """The drafts past the stop token are accepted by the model but never emitted; the prefix cache then
    holds only emitted tokens, so the same prompt again gives the same output from the cache."""
    p = prompts(1, seed=6)[0]
    ref = _greedy(make_engine(), [p], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].output_ids
    stop = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=[ref[3]])
    want = ref[: ref.index(ref[3]) + 1]
    e = make_engine(speculative_algorithm="ngram", speculative_num_draft_tokens=6)
    e.drafter = OracleDrafter({tuple(p): ref}, 6, wrong_every=10**9)
    first = _greedy(e, [p], stop)[0]
    assert first.output_ids == want and first.finish_reason.value == "stop"
    assert first.spec_accepted_tokens >= len(want) - 1  # the stop token itself was an accepted draft
    again = _greedy(e, [p], stop)[0]
    assert again.output_ids == want and again.cached_len > 0
