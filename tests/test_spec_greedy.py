"""Speculative decoding keeps greedy output token-identical to decoding one token at a time.

Drafts come from an oracle that knows the greedy continuation and is wrong on a schedule, so
verify steps accept all, some or none of their drafts; tree drafts put the right branch after a
decoy, so the accepted K/V is moved. Llama (MHA) and DeepSeek (MLA) tiny checkpoints, page sizes
1 and 16, batched and alone, with prefix-cache hits. Every page comes back.
"""

from __future__ import annotations

import pytest
from engine_helpers import prompts, shared_model, tiny_model
from spec_helpers import OracleDrafter
from test_engine_models import CONFIGS

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

PROMPTS = prompts(5, seed=11, shared_prefix=20, lo=3, hi=20)
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=2)
_BUNDLES = {}


def _bundle(name):
    if name not in _BUNDLES:
        _BUNDLES[name] = shared_model() if name == "llama" else tiny_model(CONFIGS["deepseek-v2-mla-moe"], seed=3)
    return _BUNDLES[name]


def _engine(name, **kw) -> Engine:
    cfg = {"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 2048,
           "chunked_prefill_size": None, **kw}
    return Engine(EngineConfig(**cfg), loaded=_bundle(name))


def _run(engine, ps, params=GREEDY):
    reqs = [engine.add_request(p, params) for p in ps]
    engine.run_until_done()
    return reqs


def _reference(name):
    e = _engine(name, disable_radix_cache=True)
    return {tuple(p): list(r.output_ids) for p, r in zip(PROMPTS, _run(e, PROMPTS))}


_REFS = {}


def reference(name):
    if name not in _REFS:
        _REFS[name] = _reference(name)
    return _REFS[name]


@pytest.mark.parametrize("name", ["llama", "deepseek"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_identical_with_oracle_drafts(name, tree, page_size):
    ref = reference(name)
    k = 4
    e = _engine(name, page_size=page_size, speculative_algorithm="ngram", speculative_num_draft_tokens=k,
                speculative_eagle_topk=2 if tree else 1)
    e.drafter = OracleDrafter(ref, k, tree=tree)
    batched = _run(e, PROMPTS)  # batched, cold cache
    again = _run(e, PROMPTS[:2])  # the shared prefix and whole prompts now come from the cache
    alone = _run(e, PROMPTS[2:3])
    assert [r.output_ids for r in batched] == [ref[tuple(p)] for p in PROMPTS]
    assert [r.output_ids for r in again] == [ref[tuple(p)] for p in PROMPTS[:2]]
    assert alone[0].output_ids == ref[tuple(PROMPTS[2])]
    assert e.stats()["cache"]["hit_tokens"] > 0
    spec = e.stats()["speculative"]
    accepted = [a for _, a in e.drafter.observed]
    assert spec["accepted_tokens"] == sum(accepted) > 0
    assert 0 in accepted and max(accepted) == k  # all, some and none accepted
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in batched)
    assert e.pages_leaked() == 0


def test_logprobs_match_plain_decoding():
    ref_engine = _engine("llama", disable_radix_cache=True)
    plain = _run(ref_engine, PROMPTS[:2])
    ref = {tuple(p): list(r.output_ids) for p, r in zip(PROMPTS, plain)}
    e = _engine("llama", speculative_algorithm="ngram", disable_radix_cache=True)
    e.drafter = OracleDrafter(ref, 4)
    got = _run(e, PROMPTS[:2])
    for a, b in zip(got, plain):
        assert [t.token_id for t in a.output_logprobs] == [t.token_id for t in b.output_logprobs]
        for x, y in zip(a.output_logprobs, b.output_logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [i for i, _ in x.top] == [i for i, _ in y.top]


class NoVerifyGraphs:
    """A graph runner that says it has verify graphs, then that none fits: the engine pads every request to
    1 + K tokens (the layout a captured graph needs) and runs eagerly."""

    def __init__(self):
        self.asked = []

    def can_run(self, bs, tokens_per_req=1, tree=False):
        if tokens_per_req == 1:
            return False  # no decode graphs either
        self.asked.append((bs, tokens_per_req, tree))
        return len(self.asked) == 1  # the engine's first question: does any verify graph exist at all


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_uniform_layout_for_verify_graphs(tree):
    ref = reference("llama")
    e = _engine("llama", speculative_algorithm="ngram", speculative_eagle_topk=2 if tree else 1)
    e.drafter = OracleDrafter(ref, 4, tree=tree)
    graphs = e.runner.graph_runner = NoVerifyGraphs()
    assert [r.output_ids for r in _run(e, PROMPTS)] == [ref[tuple(p)] for p in PROMPTS]
    steps = graphs.asked[1:]
    assert steps and all(q == 5 for _, q, _ in steps)
    assert {t for _, _, t in steps} == {tree}
    assert e.pages_leaked() == 0
