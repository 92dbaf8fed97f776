"""What attnserve selects for MLA models now that triton and flashinfer run MLA: the real feature tables."""

from dataclasses import replace

import pytest

from attnserve.attention import measured
from attnserve.attention.selection import ServingFeatures, select_backends
from attnserve.hardware import PRESET_HARDWARE
from attnserve.models.config import ModelConfig

H200 = replace(PRESET_HARDWARE["h200"], installed=frozenset({"torch", "triton", "flashinfer"}))
DSV2_LITE = ModelConfig.load("deepseek-v2-lite").attention_shape("deepseek-v2-lite")


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


def test_the_measured_mla_race_puts_deepseek_on_flashinfer_both_sides():
    """The committed H200 MLA race (FlashInfer MLA fa3 ahead of our MLA kernels on both sides: 1.26x decode, 1.30x
    extend in mean time) decides MLA models, not the MHA race, where our Triton decode wins; the trace cites the
    measured ratio and its source."""
    sel = select_backends(H200, DSV2_LITE)
    assert (sel.prefill_backend, sel.decode_backend) == ("flashinfer", "flashinfer"), sel.describe()
    for side in ("prefill", "decode"):
        order, entry = measured.measured_order(H200, side, "MLA")
        assert order[:2] == ("flashinfer", "triton") and entry["source"].endswith("kernels-mla-h200.json")
        assert entry["scores"][side]["triton"] > 1.0  # what the race measured: triton slower on both sides
        cited = [e.reason for e in sel.trace if e.side == side and "measured on this GPU model for MLA" in e.reason]
        assert cited and f"triton {entry['scores'][side]['triton']:.2f}x" in cited[0], sel.describe()
    # the MHA order is a different race: a Llama model still decodes on triton there
    assert measured.measured_order(H200, "decode", "MHA")[0][0] == "triton"


def test_sglang_answers_ignore_attnserve_only_limits():
    sel = select_backends(H200, DSV2_LITE, ServingFeatures(kv_cache_dtype="fp8_e5m2"), sglang=True)
    assert "e4m3 latents only" not in sel.describe()
