"""What attnserve selects for MLA models now that triton and flashinfer run MLA: the real feature tables."""

from dataclasses import replace

import pytest

from attnserve.choice import measured
from attnserve.choice.selection import ServingFeatures, select_backends
from attnserve.hardware import PRESET_HARDWARE
from attnserve.models.config import ModelConfig

H200 = replace(PRESET_HARDWARE["h200"], installed=frozenset({"torch", "triton", "flashinfer"}))
DSV2_LITE = ModelConfig.load("deepseek-v2-lite").attention_shape("deepseek-v2-lite")
DSV3 = ModelConfig.load("deepseek-v3").attention_shape("deepseek-v3")


@pytest.fixture
def static_fallback_order(monkeypatch):
    """No shipped race: the static FALLBACK_ORDER alone decides after the policy's choice."""
    monkeypatch.setattr(measured, "_shipped", dict)


@pytest.mark.parametrize("serving,prefill,decode,reason", [
    ({}, "flashinfer", "flashinfer", "MLA on Hopper"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "flashinfer", "flashinfer", "MLA on Hopper"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "triton", "triton", "reads FP8 e4m3 latents only"),
    ({"speculative_topk": 2}, "triton", "triton", "no custom masks for tree"),
])
@pytest.mark.usefixtures("static_fallback_order")
def test_deepseek_on_an_h200_runs_our_mla_backends(serving, prefill, decode, reason):
    sel = select_backends(H200, DSV2_LITE, ServingFeatures(**serving))
    assert (sel.prefill_backend, sel.decode_backend) == (prefill, decode), sel.describe()
    assert sel.cuda_graph and "torch_native" not in (sel.prefill_backend, sel.decode_backend)
    assert reason in sel.describe()


def test_only_triton_installed_serves_deepseek_with_triton():
    """The shipped MLA race ranks triton next after FlashInfer: without FlashInfer it beats torch_native."""
    hw = replace(H200, installed=frozenset({"torch", "triton"}))
    sel = select_backends(hw, DSV2_LITE)
    assert (sel.prefill_backend, sel.decode_backend) == ("triton", "triton")


def test_the_measured_mla_race_decides_deepseek_per_head_count():
    """The committed H200 MLA race (kernels-race-mla-h200-1.json) decides MLA models, not the MHA race: at
    DeepSeek-V2-Lite's 16 heads our decode is ahead of FlashInfer MLA fa3 (the narrow Gluon kernel) and FlashInfer's
    prefill ahead of ours; at V3's 128 heads the same (the scorer Gluon kernel: 1.43x at one long request outweighs
    0.98x and 0.96x on the others, on average over the three). The trace cites the head count, the measured ratio
    and the source."""
    for model, heads, expected in ((DSV2_LITE, 16, ("flashinfer", "triton")),
                                   (DSV3, 128, ("flashinfer", "triton"))):
        sel = select_backends(H200, model)
        assert model.num_q_heads == heads and (sel.prefill_backend, sel.decode_backend) == expected, sel.describe()
        for side, backend in zip(("prefill", "decode"), expected):
            order, entry = measured.measured_order(H200, side, "MLA", heads)
            assert order[0] == backend and entry["heads"] == heads and entry["source"] == "kernels-race-mla-h200-1.json"
            other = "triton" if backend == "flashinfer" else "flashinfer"
            assert entry["scores"][side][other] > 1.0  # what the race measured: the other one slower there
            cited = [e.reason for e in sel.trace
                     if e.side == side and f"measured on this GPU model for MLA at {heads} query heads" in e.reason]
            assert cited and f"{other} {entry['scores'][side][other]:.2f}x" in cited[0], sel.describe()
    # the MHA order is a different race: a Llama model still decodes on triton there
    assert measured.measured_order(H200, "decode", "MHA")[0][0] == "triton"


def test_sglang_answers_ignore_attnserve_only_limits():
    sel = select_backends(H200, DSV2_LITE, ServingFeatures(kv_cache_dtype="fp8_e5m2"), sglang=True)
    assert "e4m3 latents only" not in sel.describe()
