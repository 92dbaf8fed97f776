"""What attnserve selects for MLA models now that triton and flashinfer run MLA: the real feature tables."""

from dataclasses import replace

import pytest

from attnserve.attention import selection
from attnserve.attention.selection import ServingFeatures, select_backends
from attnserve.hardware import PRESET_HARDWARE
from attnserve.models.config import ModelConfig

H200 = replace(PRESET_HARDWARE["h200"], installed=frozenset({"torch", "triton", "flashinfer"}))
DSV2_LITE = ModelConfig.load("deepseek-v2-lite").attention_shape("deepseek-v2-lite")


@pytest.fixture(autouse=True)
def static_fallback_order(monkeypatch, tmp_path):
    monkeypatch.setattr(selection, "MEASUREMENTS_DIR", tmp_path / "none")


@pytest.mark.parametrize("serving,prefill,decode,reason", [
    ({}, "flashinfer", "flashinfer", "MLA on Hopper"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "flashinfer", "flashinfer", "MLA on Hopper"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "triton", "triton", "reads FP8 e4m3 latents only"),
    ({"speculative_topk": 2}, "triton", "triton", "no custom masks for tree"),
])
def test_deepseek_on_an_h200_runs_our_mla_backends(serving, prefill, decode, reason):
    sel = select_backends(H200, DSV2_LITE, ServingFeatures(**serving))
    assert (sel.prefill_backend, sel.decode_backend) == (prefill, decode), sel.describe()
    assert sel.cuda_graph and "torch_native" not in (sel.prefill_backend, sel.decode_backend)
    assert reason in sel.describe()


def test_only_triton_installed_serves_deepseek_with_triton():
    hw = replace(H200, installed=frozenset({"torch", "triton"}))
    sel = select_backends(hw, DSV2_LITE)
    assert (sel.prefill_backend, sel.decode_backend) == ("triton", "triton")


def test_sglang_answers_ignore_attnserve_only_limits():
    sel = select_backends(H200, DSV2_LITE, ServingFeatures(kv_cache_dtype="fp8_e5m2"), sglang=True)
    assert "e4m3 latents only" not in sel.describe()
