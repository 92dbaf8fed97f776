"""A tiny random DeepSeek (MLA + MoE with a shared expert) through the engine: the same greedy tokens and close
logits with the fused MoE kernel on (the interpreter on the CPU) and with the unfused torch paths."""

import dataclasses

import pytest
import test_ops_fused_model
from attention_helpers import rel_err
from engine_helpers import tiny_model
from test_engine_models import CONFIGS

pytest.importorskip("triton")


def test_greedy_outputs_identical_with_the_fused_moe_on_and_off(monkeypatch):
    from attnserve.ops import triton_ops

    fused = triton_ops()
    calls = []
    counting = dataclasses.replace(fused, fused_moe=lambda *a, **k: calls.append(len(a[0])) or fused.fused_moe(*a, **k))
    monkeypatch.setattr(test_ops_fused_model, "triton_ops", lambda: counting)
    bundle = tiny_model(CONFIGS["deepseek-v2-mla-moe"], seed=4)
    out_off, logits_off = test_ops_fused_model._run(bundle, fused=False)
    assert not calls
    out_on, logits_on = test_ops_fused_model._run(bundle, fused=True)
    assert len(calls) == len(logits_on)  # one MoE layer: every step went through the kernel
    assert out_on == out_off
    for a, b in zip(logits_on, logits_off):
        assert rel_err(a, b) < 1e-5
