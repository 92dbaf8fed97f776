"""Speculative decoding at tensor-parallel size 2 (gloo, CPU): tree verify steps whose accepted branch is
moved in every rank's K/V, in a small pool that preempts, give tp 1's greedy tokens without speculation."""

from __future__ import annotations

from engine_helpers import prompts
from spec_helpers import OracleDrafter
from tp_helpers import TINY_LLAMA_TP, write_checkpoint

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

PROMPTS = prompts(4, seed=5, shared_prefix=10, lo=4, hi=24)
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def _run(path, tp: int, drafter_refs=None, **kw):
    settings = {"model": str(path), "device": "cpu", "dtype": "fp32", "attention_backend": "torch_native",
                "tp_size": tp, "page_size": 4, "max_total_tokens": 96, "max_running_requests": 8, **kw}
    e = Engine(EngineConfig(**settings))
    try:
        if drafter_refs is not None:
            e.drafter = OracleDrafter(drafter_refs, 4, tree=True)
        reqs = [e.add_request(p, GREEDY) for p in PROMPTS]
        e.run_until_done()
        return [r.output_ids for r in reqs], e.stats(), e.pages_leaked()
    finally:
        e.close()


def test_tree_speculation_at_tp2_matches_tp1(tmp_path):
    path = write_checkpoint(TINY_LLAMA_TP, tmp_path, seed=4)
    ref, _, _ = _run(path, 1)
    got, stats, leaked = _run(path, 2, {tuple(p): o for p, o in zip(PROMPTS, ref)}, speculative_algorithm="ngram",
                              speculative_num_draft_tokens=4, speculative_eagle_topk=2)
    assert got == ref
    assert stats["speculative"]["accepted_tokens"] > 0
    assert leaked == 0
