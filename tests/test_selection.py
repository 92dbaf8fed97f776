"""Default backend selection: a table of GPU x model x features -> backends and the key reason.

`sglang` rows ask what SGLang's policy would run (its unimplemented backends count);
the others ask what attnserve can instantiate, from the registry's real feature
tables. Where that answer turns on a feature one of our backends may gain (Triton's
MLA or ROCm support, a deterministic mode), the row names the backends in fallback
order with the feature they need (`first_with`), so the table follows the backends
instead of pinning today's flags.
"""

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest

from attnserve.choice import measured, selection
from attnserve.choice.ranking import rank
from attnserve.choice.registry import get_spec
from attnserve.choice.selection import ServingFeatures, select_backends
from attnserve.hardware import PRESET_HARDWARE
from attnserve.models.config import ModelConfig
from attnserve.shape import GENERIC_GQA


@pytest.fixture(autouse=True)
def static_fallback_order(monkeypatch):
    monkeypatch.setattr(measured, "_shipped", dict)  # no measured order shipped for any GPU


def first_with(*names, device, attention="GQA", deterministic=False):
    """The first of `names` whose real features run `attention` on `device` (and deterministically if asked);
    None when none does (selection must then refuse with a ValueError)."""
    for name in names:
        f = get_spec(name).features
        if device in f.devices and attention in f.attention_types and (f.deterministic or not deterministic):
            return name
    return None


# attnserve's answers that depend on our backends' features (fallback order after the policy's choice)
MI300_LLAMA = first_with("triton", "flex_attention", "torch_native", device="rocm")
H100_DETERMINISTIC = first_with("flashinfer", "triton", "flex_attention", "torch_native", device="cuda",
                                deterministic=True)


def _preset(name, tp=1):
    return ModelConfig.load(name).attention_shape(name).per_rank(tp)


LLAMA = _preset("llama-3-8b")
MODELS = {
    "llama": LLAMA,
    "mistral": _preset("mistral-7b"),
    "dsv3": _preset("deepseek-v3"),
    "dsv3-tp8": _preset("deepseek-v3", 8),
    "dsv2lite": _preset("deepseek-v2-lite"),
    "dsv2lite-tp2": _preset("deepseek-v2-lite", 2),
    "sinks": dataclasses.replace(LLAMA, has_sinks=True, model_type="gpt_oss", name="gpt-oss-like"),
    "asym": dataclasses.replace(LLAMA, v_head_dim=64, name="asymmetric"),
}


def _hw(spec: str):
    """'h100', 'h100@cuda=12.2', 'h100@installed=triton' (installed= with nothing: only torch)."""
    name, _, extra = spec.partition("@")
    hw = PRESET_HARDWARE[name]
    if extra.startswith("cuda="):
        hw = dataclasses.replace(hw, cuda_version=tuple(int(x) for x in extra[5:].split(".")))
    elif extra.startswith("installed="):
        pkgs = frozenset(p for p in extra[10:].split(",") if p) | {"torch"}
        hw = dataclasses.replace(hw, installed=pkgs)
    return hw


# (gpu, model, serving, sglang?, prefill, decode, a reason the trace must hold)
CASES = [
    # SGLang's policy rows
    ("h100", "llama", {}, True, "fa3", "fa3", "17411"),
    ("h200", "llama", {"speculative_topk": 4}, True, "flashinfer", "flashinfer", "general NVIDIA default"),
    ("h100@cuda=12.2", "llama", {}, True, "flashinfer", "flashinfer", "general NVIDIA default"),
    ("h20", "llama", {}, True, "fa3", "fa3", "Hopper"),
    ("b200", "llama", {}, True, "trtllm_mha", "trtllm_mha", "page size 64"),
    ("gb300", "llama", {}, True, "trtllm_mha", "trtllm_mha", "Blackwell default"),
    ("b200", "asym", {}, True, "fa4", "triton", "prefill only"),
    ("b200", "llama", {"speculative_topk": 2}, True, "flashinfer", "flashinfer", "general NVIDIA default"),
    ("b200", "dsv3", {}, True, "trtllm_mla", "trtllm_mla", "DeepSeek-V3/R1 on SM100"),
    ("b200", "dsv2lite", {}, True, "flashinfer", "flashinfer", "MLA on SM100"),
    ("h100", "dsv3", {}, True, "fa3", "fa3", "MLA on Hopper"),
    ("h100", "dsv3", {"speculative_topk": 2, "page_size": 16}, True, "flashinfer", "flashinfer",
     "needs page size 1 on fa3"),
    ("mi300", "llama", {}, True, "aiter", "aiter", "AMD ROCm"),
    ("mi300", "dsv3-tp8", {}, True, "aiter", "aiter", "16 or 128 heads per rank"),
    ("mi355", "dsv2lite-tp2", {}, True, "triton", "triton", "head count aiter lacks"),
    ("mi300", "sinks", {}, True, "triton", "triton", "no attention sinks"),
    ("mps", "llama", {}, True, "torch_native", "torch_native", "Apple MPS"),
    ("mps", "dsv3", {}, True, "torch_native", "torch_native", "Apple MPS"),
    ("arm-cpu", "llama", {}, True, "torch_native", "torch_native", "ARM64"),
    ("cpu-amx", "llama", {}, True, "intel_amx", "intel_amx", "AMX"),
    ("xpu", "llama", {}, True, "intel_xpu", "intel_xpu", "Intel GPU"),
    ("npu", "dsv3", {}, True, "ascend", "ascend", "Ascend"),
    ("l4", "llama", {}, True, "flashinfer", "flashinfer", "general NVIDIA default"),
    ("l4", "sinks", {}, True, "triton", "triton", "attention sinks, which FlashInfer can't run"),
    ("h100", "sinks", {}, True, "fa3", "fa3", "17411"),
    ("b200", "sinks", {}, True, "trtllm_mha", "trtllm_mha", "Blackwell default"),
    ("a100", "dsv3", {}, True, "triton", "triton", "MLA elsewhere"),
    ("rtx5090", "llama", {}, True, "flashinfer", "flashinfer", "general NVIDIA default"),
    ("h100", "llama", {"kv_cache_dtype": "fp8_e5m2"}, True, "flashinfer", "flashinfer", "KV dtype fp8_e5m2"),
    ("h100", "llama", {"speculative_topk": 2, "page_size": 64}, True, "flashinfer", "flashinfer", "NVIDIA"),
    ("b200", "llama", {"page_size": 16}, True, "trtllm_mha", "trtllm_mha", "Blackwell default"),
    ("b200", "dsv3", {"page_size": 16}, True, "flashinfer", "flashinfer", "page size 16 unsupported"),
    ("h100", "mistral", {}, True, "fa3", "fa3", "17411"),
    # what attnserve runs: SGLang's choice first, then the fallback order, each fall recorded
    ("h100", "llama", {}, False, "flashinfer", "flashinfer", "not implemented in attnserve"),
    ("b200", "llama", {}, False, "flashinfer", "flashinfer", "not implemented in attnserve"),
    ("mi300", "llama", {}, False, MI300_LLAMA, MI300_LLAMA, "not implemented in attnserve"),
    ("cpu", "llama", {}, False, "torch_native", "torch_native", "CPU"),
    ("cpu", "dsv3", {}, False, "torch_native", "torch_native", "CPU"),
    ("cpu", "llama", {"kv_cache_dtype": "fp8_e4m3"}, False, "torch_native", "torch_native", "CPU"),
    ("cpu-amx", "llama", {}, False, "torch_native", "torch_native", "not implemented in attnserve"),
    ("h100", "dsv3", {}, False, "flashinfer", "flashinfer", "MLA on Hopper"),
    ("l4", "sinks", {}, False, "triton", "triton", "attention sinks"),
    ("l4", "mistral", {}, False, "flashinfer", "flashinfer", "general NVIDIA default"),
    ("h100", "llama", {"deterministic": True}, False, H100_DETERMINISTIC, H100_DETERMINISTIC,
     "no deterministic mode"),
    ("h100", "llama", {"kv_cache_dtype": "fp8_e4m3"}, False, "flashinfer", "flashinfer", "17411"),
    ("h100@installed=triton", "llama", {}, False, "triton", "triton", "package 'flashinfer' is not installed"),
    ("h100@installed=", "llama", {}, False, "flex_attention", "flex_attention", "CUDA graphs disabled"),
    ("mps", "llama", {}, False, "torch_native", "torch_native", "Apple MPS"),
]


@pytest.mark.parametrize("gpu,model,serving,sglang,prefill,decode,reason", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'sglang' if c[3] else 'attnserve'}-{i}" for i, c in enumerate(CASES)])
def test_selection_table(gpu, model, serving, sglang, prefill, decode, reason):
    if prefill is None:  # no backend attnserve implements runs here: a refusal that says why
        with pytest.raises(ValueError, match="no attention backend can serve") as err:
            select_backends(_hw(gpu), MODELS[model], ServingFeatures(**serving), sglang=sglang)
        assert reason in str(err.value)
        return
    sel = select_backends(_hw(gpu), MODELS[model], ServingFeatures(**serving), sglang=sglang)
    assert (sel.prefill_backend, sel.decode_backend) == (prefill, decode), sel.describe()
    assert any(reason in e.reason for e in sel.trace), f"no trace entry mentions {reason!r}:\n{sel.describe()}"
    assert sel.is_hybrid == (prefill != decode)


def test_table_is_large_and_covers_every_policy_row():
    assert len(CASES) >= 30
    hit = set()
    for gpu, model, serving, sglang, *_ in CASES:
        hw, m, s = _hw(gpu), MODELS[model], ServingFeatures(**serving)
        hit.add(selection.POLICY.index(selection.policy_row(hw, m, s)))
    assert hit == set(range(len(selection.POLICY)))


def test_page_size_follows_the_backend_that_needs_one():
    sel = select_backends(PRESET_HARDWARE["b200"], MODELS["dsv3"], sglang=True)
    assert sel.page_size == 64
    sel = select_backends(PRESET_HARDWARE["b200"], MODELS["asym"], sglang=True)
    assert sel.page_size == 128  # fa4's native page, and triton decodes at it too
    sel = select_backends(PRESET_HARDWARE["h100"], LLAMA)
    assert sel.page_size == 1


def test_cuda_graphs_follow_the_decode_backend():
    assert select_backends(PRESET_HARDWARE["h100"], LLAMA).cuda_graph
    assert not select_backends(PRESET_HARDWARE["h100"], LLAMA, attention_backend="flex_attention").cuda_graph
    assert not select_backends(PRESET_HARDWARE["cpu"], LLAMA).cuda_graph


def test_ranking_scores_each_backend_against_each_workloads_fastest():
    records = [
        {"workload": "decode 64x4096 p1", "backend": "triton", "us": 250.0, "tbps": 4.3},
        {"workload": "decode 64x4096 p1", "backend": "flashinfer", "us": 300.0, "tbps": 3.9},
        {"workload": "decode 64x4096 p1", "backend": "torch_native", "us": 9000.0, "tbps": 0.1},
        {"workload": "prefill 8x2048", "backend": "triton", "us": 900.0, "tflops": 306},
        {"workload": "prefill 8x2048", "backend": "flashinfer-fa2", "us": 1000.0, "tflops": 340},
        {"workload": "prefill 8x2048", "backend": "flashinfer-fa3", "us": 500.0, "tflops": 571},  # counts
        {"workload": "prefill 8x2048", "backend": "fa3", "us": 10.0},  # not ours: ignored
        {"workload": "prefill 8x2048", "backend": "sdpa-cudnn", "us": 10.0},  # not a backend: ignored
    ]
    # triton: (1 + 1.8) / 2 = 1.4; flashinfer: (1.2 + 1) / 2 = 1.1; torch_native 36
    assert [r.backend for r in rank(records)] == ["flashinfer", "triton", "torch_native"]
    assert [r.backend for r in rank(records, "decode")] == ["triton", "flashinfer", "torch_native"]
    assert [r.backend for r in rank(records, "prefill")] == ["flashinfer", "triton"]
    # complete_only: a backend missing from one of the side's workloads can't serve it
    partial = records + [{"workload": "decode 1x32768 p1", "backend": "triton", "us": 40.0}]
    assert [r.backend for r in rank(partial, "decode", complete_only=True)] == ["triton"]


def test_measured_order_per_gpu_model_attention_type_and_side(monkeypatch):
    shipped = {"h200": {"MHA": {"source": "x.json", "date": "2026-11-29", "decode": ["triton", "flashinfer"],
                                "prefill": ["flashinfer", "triton"]},
                        "MLA": {"source": "y.json", "date": "2026-12-01", "decode": ["flashinfer", "triton"],
                                "prefill": ["flashinfer", "triton"],
                                "scores": {"decode": {"flashinfer": 1.0, "triton": 5.38}}}}}
    monkeypatch.setattr(measured, "_shipped", lambda: shipped)
    h200 = PRESET_HARDWARE["h200"]
    assert measured.measured_order(h200, "decode")[0] == ("triton", "flashinfer")
    assert measured.measured_order(h200, "prefill")[0] == ("flashinfer", "triton")
    assert measured.measured_order(h200, "decode", "MLA")[0] == ("flashinfer", "triton")
    assert measured.measured_order(h200, "decode", "GQA")[0] == ("triton", "flashinfer")  # GQA races as MHA
    assert measured.describe_order(shipped["h200"]["MLA"], "decode") == "flashinfer 1.00x, triton 5.38x"
    assert measured.measured_order(PRESET_HARDWARE["h100"], "decode") is None  # nothing shipped for this GPU
    assert measured.measured_order(PRESET_HARDWARE["cpu"], "decode") is None
    with pytest.raises(ValueError, match="'verify'"):
        measured.measured_order(h200, "verify")


def test_measured_order_per_head_count_takes_the_nearest_raced(monkeypatch):
    """An MLA race over 16 and 128 heads ships an order for each; a model takes the count nearest its heads per
    rank (by ratio, the larger on a tie), and without heads, or for MHA, the order over all workloads."""
    by_heads = {"16": {"decode": ["triton", "flashinfer"], "prefill": ["flashinfer", "triton"],
                       "scores": {"decode": {"triton": 1.0, "flashinfer": 1.04}}},
                "128": {"decode": ["flashinfer", "triton"], "prefill": ["flashinfer", "triton"],
                        "scores": {"decode": {"flashinfer": 1.0, "triton": 1.2}}}}
    shipped = {"h200": {"MLA": {"source": "y.json", "date": "d", "decode": ["flashinfer", "triton"],
                                "prefill": ["flashinfer", "triton"], "by_heads": by_heads},
                        "MHA": {"source": "x.json", "date": "d", "decode": ["triton"], "prefill": ["flashinfer"]}}}
    monkeypatch.setattr(measured, "_shipped", lambda: shipped)
    h200 = PRESET_HARDWARE["h200"]
    order = lambda heads, attention="MLA": measured.measured_order(h200, "decode", attention, heads)  # noqa: E731
    assert order(16)[0] == ("triton", "flashinfer") and order(16)[1]["heads"] == 16
    assert measured.describe_order(order(16)[1], "decode") == "triton 1.00x, flashinfer 1.04x"
    assert order(128)[0] == ("flashinfer", "triton") and order(128)[1]["heads"] == 128
    assert order(32)[1]["heads"] == 16 and order(64)[1]["heads"] == 128 and order(8)[1]["heads"] == 16
    assert order(None)[0] == ("flashinfer", "triton") and "heads" not in order(None)[1]
    assert order(16, "MHA")[0] == ("triton",)
    installed = replace(h200, installed=frozenset({"torch", "triton", "flashinfer"}))
    sel = select_backends(installed, MODELS["dsv2lite"])
    assert (sel.prefill_backend, sel.decode_backend) == ("flashinfer", "triton")
    assert any(e.side == "decode" and "MLA at 16 query heads:" in e.reason for e in sel.trace)
    sel = select_backends(installed, MODELS["dsv3"])
    assert sel.decode_backend == "flashinfer"
    assert any(e.side == "decode" and "MLA at 128 query heads:" in e.reason for e in sel.trace)


def test_a_race_over_several_head_counts_is_also_ranked_per_head_count():
    records = [
        {"workload": "mla decode 128x4096 h128 p1", "backend": "triton", "us": 320.0},
        {"workload": "mla decode 128x4096 h128 p1", "backend": "flashinfer-mla-fa3", "us": 265.0},
        {"workload": "mla decode 128x4096 h16 p64", "backend": "triton", "us": 143.0},
        {"workload": "mla decode 128x4096 h16 p64", "backend": "flashinfer-mla-fa3", "us": 149.0},
        {"workload": "decode 64x4096 p1", "backend": "triton", "us": 100.0},
    ]
    entries = measured.order_entry({"gpu": "NVIDIA H200", "date": "d", "records": records}, "r.json")
    mla = entries["MLA"]
    assert mla["decode"] == ["flashinfer", "triton"]  # over both head counts
    assert sorted(mla["by_heads"]) == ["128", "16"]
    assert mla["by_heads"]["16"]["decode"] == ["triton", "flashinfer"]
    assert mla["by_heads"]["128"]["scores"]["decode"] == {"flashinfer": 1.0, "triton": round(320 / 265, 2)}
    assert "by_heads" not in entries["MHA"]  # one shape raced: nothing to split


def test_mla_and_mha_records_are_ranked_apart():
    """'mla decode ...' workloads are MLA's race: they must not move the MHA order, nor the other way."""
    records = [
        {"workload": "decode 64x4096 p1", "backend": "triton", "us": 100.0},
        {"workload": "decode 64x4096 p1", "backend": "flashinfer-fa3", "us": 110.0},
        {"workload": "mla decode 128x4096 h128 p1", "backend": "triton", "us": 1900.0},
        {"workload": "mla decode 128x4096 h128 p1", "backend": "flashinfer-mla-fa3", "us": 265.0},
        {"workload": "mla extend 8x(4096+512) h128 p1", "backend": "triton", "us": 33000.0},
        {"workload": "mla extend 8x(4096+512) h128 p1", "backend": "flashinfer-mla-fa3", "us": 8800.0},
        {"workload": "decode 8x8192 p1", "backend": "triton", "us": 50.0, "attention": "MLA"},
        {"workload": "decode 8x8192 p1", "backend": "flashinfer", "us": 10.0, "attention": "MLA"},
    ]
    assert [r.backend for r in rank(records, "decode", attention="MHA")] == ["triton", "flashinfer"]
    mla = rank(records, "decode", attention="MLA")
    assert [r.backend for r in mla] == ["flashinfer", "triton"] and mla[1].score == pytest.approx((1900 / 265 + 5) / 2)
    assert [r.backend for r in rank(records, "prefill", attention="MLA")] == ["flashinfer", "triton"]
    assert rank(records, "prefill", attention="MHA") == []
    entries = measured.order_entry({"gpu": "NVIDIA H200", "date": "d", "records": records}, "r.json")
    assert sorted(entries) == ["MHA", "MLA"] and entries["MLA"]["decode"] == ["flashinfer", "triton"]
    with pytest.raises(ValueError, match="'GQA'"):
        rank(records, attention="GQA")


def test_the_shipped_order_is_the_committed_race(monkeypatch):
    """Package data (so a wheel has it), kept equal to what the committed race measured."""
    monkeypatch.undo()  # the real package data
    measured._shipped.cache_clear()
    root = Path(selection.__file__).resolve().parents[3]
    shipped = measured._shipped()
    assert sorted(shipped["h200"]) == ["MHA", "MLA"]  # both committed H200 races are shipped
    for key, per_attention in shipped.items():
        for attention, entry in per_attention.items():
            result = json.loads((root / "benchmarks" / "results" / entry["source"]).read_text())
            assert measured.gpu_key(result["gpu"]) == key
            assert entry == measured.order_entry(result, entry["source"])[attention], (
                f"run: python tools/ship_measured_order.py benchmarks/results/{entry['source']}")


def test_hopper_without_fa3_takes_the_fastest_measured_backend_per_side(monkeypatch):
    """The shipped H200 race against FlashInfer fa3 and FA4 (kernels-race-h200-1.json): our prefill ahead of both on
    average over its four cases, our decode ahead of FlashInfer's; without our kernels FlashInfer's prefill is next."""
    monkeypatch.undo()
    h200 = PRESET_HARDWARE["h200"]
    assert measured.measured_order(h200, "prefill")[0] == ("triton", "flashinfer", "fa4")
    assert measured.measured_order(h200, "decode")[0] == ("triton", "flashinfer")
    sel = select_backends(replace(h200, installed=frozenset({"torch", "triton", "flashinfer"})), LLAMA)
    assert (sel.prefill_backend, sel.decode_backend) == ("triton", "triton")
    assert any(e.side == "prefill" and "fallback order measured" in e.reason for e in sel.trace)
    sel = select_backends(replace(h200, installed=frozenset({"torch", "flashinfer"})), LLAMA)
    assert sel.prefill_backend == "flashinfer"


def test_shapes_per_rank_from_presets():
    assert MODELS["dsv3"].attention_type == "MLA" and MODELS["dsv3"].num_q_heads == 128
    assert MODELS["dsv3-tp8"].num_q_heads == 16
    assert MODELS["mistral"].sliding_window
    assert MODELS["asym"].kv_widths_differ and not LLAMA.kv_widths_differ
    with pytest.raises(ValueError, match="tp_size 3"):
        _preset("llama-3-8b", 3)


@pytest.mark.parametrize("bad", [{"speculative_topk": -1}, {"page_size": 3}, {"kv_cache_dtype": "int4"}])
def test_serving_features_reject_bad_values(bad):
    with pytest.raises(ValueError):
        ServingFeatures(**bad)


def test_shape_rejects_bad_attention_type():
    with pytest.raises(ValueError, match="MHA, GQA or MLA"):
        dataclasses.replace(GENERIC_GQA, attention_type="MQA")
