"""The KV-cache calculator's numbers, checked against published figures and against the pools."""

import json

import pytest

from attnserve.kvcache.calc import (
    decode_intensity,
    decode_step_intensity,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_cache_report,
    max_batch,
    prefill_intensity,
    weight_bytes,
)
from attnserve.kvcache.pool import MHAKVPool, MLAKVPool
from attnserve.models.config import ModelConfig
from attnserve.presets import PRESETS
from attnserve.shape import AttentionShape

KiB, GiB = 1024, 1024**3


def shape(name: str) -> AttentionShape:
    return ModelConfig.load(name).attention_shape()


@pytest.mark.parametrize(
    "model,per_token",
    [("llama-2-7b", 512 * KiB), ("llama-3-8b", 128 * KiB), ("llama-3-70b", 320 * KiB),
     ("deepseek-v2", 67.5 * KiB), ("deepseek-v3", 61 * 576 * 2), ("llama-2-70b", 320 * KiB),
     ("smollm2-135m", 30 * 3 * 128 * 2)],
)
def test_bytes_per_token(model, per_token):
    assert kv_bytes_per_token(shape(model), "bf16") == per_token


def test_published_cache_sizes():
    assert kv_cache_bytes(shape("llama-2-7b"), context=4096, batch=1) == 2 * GiB
    assert kv_cache_bytes(shape("llama-3-70b"), context=8192, batch=64) == 160 * GiB
    assert format_bytes(kv_bytes_per_token(shape("deepseek-v2"))) == "67.50 KiB"
    assert format_bytes(160 * GiB) == "160 GiB"


def test_fp8_halves_and_fp32_doubles_the_cache():
    s = shape("llama-3-8b")
    assert kv_bytes_per_token(s, "fp8_e4m3") * 2 == kv_bytes_per_token(s, "bf16")
    assert kv_bytes_per_token(s, "fp32") == 2 * kv_bytes_per_token(s, "bf16")
    with pytest.raises(ValueError, match="int2"):
        kv_bytes_per_token(s, "int2")


@pytest.mark.parametrize("model", ["llama-3-8b", "mistral-7b", "smollm2-135m", "deepseek-v2-lite"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_calculator_agrees_with_the_pool_it_describes(model, kv_dtype):
    s = shape(model)
    if s.attention_type == "MLA":
        pool = MLAKVPool(2, 1, s.num_layers, s.kv_lora_rank, s.qk_rope_head_dim, dtype=kv_dtype, device="meta")
    else:
        pool = MHAKVPool(2, 1, s.num_layers, s.num_kv_heads, s.head_dim, s.v_head_dim, dtype=kv_dtype,
                         device="meta")
    assert kv_bytes_per_token(s, kv_dtype) == pool.bytes_per_token


def test_max_batch_fits_beside_the_weights():
    s = shape("llama-3-70b")
    mem = 640 * 10**9
    n = max_batch(s, 8192, mem)
    free = mem - weight_bytes(s)
    assert n * 8192 * kv_bytes_per_token(s) <= free < (n + 1) * 8192 * kv_bytes_per_token(s)
    assert max_batch(s, 8192, 80 * 10**9) == 0  # 141 GB of weights do not fit in 80 GB
    assert max_batch(s, 8192, mem, kv_dtype="fp8_e4m3") in (2 * n, 2 * n + 1)
    assert max_batch(s, 8192, mem, weight_dtype="fp8") > n


def test_parameter_estimates_match_published_sizes():
    published = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "llama-3-405b": 405.9e9,
                 "mistral-7b": 7.24e9, "qwen3-8b": 8.19e9, "deepseek-v2": 236e9, "deepseek-v3": 671e9,
                 "deepseek-v2-lite": 15.7e9, "smollm2-135m": 134.5e6}
    for name, n in published.items():
        assert abs(ModelConfig.from_hf(PRESETS[name]).num_params() / n - 1) < 0.01, name
    active = ModelConfig.from_hf(PRESETS["deepseek-v3"]).num_params(active_only=True)
    assert 36e9 < active < 39e9  # 37B activated per token


def test_decode_intensity_follows_the_gqa_ratio():
    # 2 FLOPs per K and V element per query head over bytes per element per KV head; q/o rows add a little
    assert decode_intensity(shape("llama-2-7b"), 4096) == pytest.approx(1.0, rel=5e-3)
    assert decode_intensity(shape("llama-3-8b"), 4096) == pytest.approx(4.0, rel=5e-3)
    assert decode_intensity(shape("llama-3-70b"), 4096) == pytest.approx(8.0, rel=5e-3)
    assert decode_intensity(shape("llama-3-8b"), 4096, "fp8_e4m3") == pytest.approx(8.0, rel=1e-2)
    mla = decode_intensity(shape("deepseek-v2"), 4096)
    assert mla == pytest.approx(2 * 128 * (576 + 512) / (576 * 2), rel=0.1)
    assert mla > 25 * decode_intensity(shape("llama-3-70b"), 4096)


def test_prefill_intensity_grows_with_context_and_beats_decode():
    s = shape("llama-3-8b")
    short, long = prefill_intensity(s, 512), prefill_intensity(s, 8192)
    assert long / short == pytest.approx((8192 + 1) / (512 + 1), rel=1e-6)
    assert short > 20 * decode_intensity(s, 512)


def test_decode_step_intensity_rises_with_batch():
    s = shape("llama-3-8b")
    one, many = decode_step_intensity(s, 1024, 1), decode_step_intensity(s, 1024, 64)
    assert one == pytest.approx(1.0, rel=0.05)  # batch 1: every weight read for one multiply-add
    assert many > 10 * one


def test_report_json_and_bad_input():
    report = kv_cache_report("llama-3-70b", shape("llama-3-70b"), 8192, 64, "bf16", gpu_memory_gb=640)
    d = json.loads(json.dumps(report.as_dict()))
    assert d["bytes_per_token"] == 320 * KiB and d["total_bytes"] == 160 * GiB
    assert d["max_batch"] == max_batch(shape("llama-3-70b"), 8192, 640 * 10**9)
    no_mem = kv_cache_report("llama-3-8b", shape("llama-3-8b"), 4096, 1).as_dict()
    assert "max_batch" not in no_mem
    for bad in ({"context": 0}, {"batch": -1}, {"gpu_memory_gb": 0}, {"weight_dtype": "int3"}):
        kwargs = {"context": 4096, "batch": 1, **bad}
        with pytest.raises(ValueError, match=str(next(iter(bad.values())))):
            kv_cache_report("llama-3-8b", shape("llama-3-8b"), **kwargs)
