"""torch_native's decode over K/V kept between steps (contiguous_decode_kv) against re-gathering and the general path.

Ragged prompts, requests finishing at different steps (the batch changes, so the copies are rebuilt),
a cap small enough to be outgrown: every step's logits must match the general path (padded gather +
matmuls) and a run that rebuilds every step.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import prompts, shared_model
from engine_runs import max_rel_err, run_engine

from attnserve.attention.backends import contiguous_decode_kv
from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.engine.sampling_params import SamplingParams


def _runs(lengths: list[int]):
    """The tiny model and (prompt, params) pairs: ragged prompts, each request its own output length."""
    ps = prompts(len(lengths), seed=3, lo=3, hi=30)
    return shared_model(), [(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps, lengths)]


def _engine_runs(bundle, items):
    from engine_runs import record_logits

    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine

    engine = Engine(EngineConfig(device="cpu", attention_backend="torch_native", max_total_tokens=2048,
                                 chunked_prefill_size=None), loaded=bundle)
    rows = record_logits(engine)
    reqs = [engine.add_request(p, prm) for p, prm in items]
    engine.run_until_done()
    assert engine.pages_leaked() == 0
    return [(r.output_ids, torch.stack(rows[r.rid][: len(r.output_ids)])) for r in reqs]


def test_kept_kv_matches_general_path_and_regather(monkeypatch):
    bundle, items = _runs([70, 9, 40, 1, 55])  # 70 steps outgrow the first cap (64 for these prompts)
    builds = []
    real = contiguous_decode_kv.plan_decode_step

    def counting(prev, fb, row_bytes, num_layers):
        step = real(prev, fb, row_bytes, num_layers)
        builds.append(not step.mirror.appending)
        return step

    monkeypatch.setattr("attnserve.attention.backends.torch_native.plan_decode_step", counting)
    kept = _engine_runs(bundle, items)
    assert builds.count(True) >= 4, "batch changes (3 requests finish) and a cap overflow must rebuild"
    assert builds.count(False) > 40, "an unchanged batch appends instead of gathering"
    monkeypatch.undo()

    monkeypatch.setattr(contiguous_decode_kv, "MAX_MIRROR_BYTES", 0)  # every step gathers afresh
    regathered = _engine_runs(bundle, items)
    monkeypatch.undo()

    monkeypatch.setattr(TorchNativeBackend, "_mirror_ok", lambda self: False)  # padded gather + matmuls
    general = _engine_runs(bundle, items)

    for (tk, lk), (tr, lr), (tg, lg) in zip(kept, regathered, general):
        assert tk == tr == tg
        assert max_rel_err(lk, lr) < 1e-6
        assert max_rel_err(lk, lg) < 1e-5


def test_plain_decode_layer_runs_sdpa_path():
    """The fast path is taken for a plain fp32 layer (no soft-cap, sinks or window), not silently skipped."""
    bundle = shared_model()
    calls = []
    real = TorchNativeBackend._forward_decode_sdpa

    def spy(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchNativeBackend, "_forward_decode_sdpa", spy)
        run_engine(bundle, prompts(2, seed=1), 4)
    assert len(calls) == 3 * 2  # 3 decode steps (the first token comes from prefill) x 2 layers
