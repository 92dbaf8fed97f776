"""Explicit backend choices: accepted when they can run, otherwise an error with every reason and the
backends that would run. Also the trace's shape."""

import dataclasses
import json

import pytest

from attnserve.choice import selection
from attnserve.choice.selection import ServingFeatures, TraceEntry, select_backends
from attnserve.hardware import PRESET_HARDWARE
from attnserve.shape import GENERIC_GQA, AttentionShape

H100, B200, L4, RTX5090, CPU = (PRESET_HARDWARE[n] for n in ("h100", "b200", "l4", "rtx5090", "cpu"))
GQA = GENERIC_GQA
MLA = AttentionShape(num_layers=61, num_q_heads=128, num_kv_heads=1, head_dim=576, v_head_dim=512,
                     attention_type="MLA", kv_lora_rank=512, qk_rope_head_dim=64, model_type="deepseek_v3")
SINKS = dataclasses.replace(GQA, has_sinks=True)


# (hardware, model, serving, request kwargs, sglang?, words the error must contain)
ERRORS = [
    (B200, GQA, {"speculative_topk": 2}, {"attention_backend": "trtllm_mha"}, True, "no speculative topk > 1"),
    (RTX5090, GQA, {}, {"attention_backend": "trtllm_mha"}, True, "sm120"),
    (L4, SINKS, {}, {"attention_backend": "flashinfer"}, False, "no attention sinks"),
    (B200, GQA, {}, {"decode_backend": "fa4"}, True, "prefill only"),
    (B200, GQA, {"page_size": 1}, {"prefill_backend": "fa4"}, True, "page size 1 unsupported (needs 128)"),
    (H100, MLA, {"page_size": 16}, {"attention_backend": "flashmla"}, True, "page size 16 unsupported (needs 64)"),
    (B200, MLA, {"page_size": 16}, {"attention_backend": "trtllm_mla"}, True, "needs 32/64"),
    (B200, MLA, {}, {"attention_backend": "cutlass_mla"}, True, "removed from SGLang"),
    (H100, GQA, {"kv_cache_dtype": "fp8_e4m3"}, {"attention_backend": "flex_attention"}, False, "KV dtype fp8_e4m3"),
    (H100, GQA, {"kv_cache_dtype": "fp8_e5m2"}, {"attention_backend": "fa3"}, True, "KV dtype fp8_e5m2"),
    (H100, MLA, {"speculative_topk": 2, "page_size": 16}, {"attention_backend": "fa3"}, True,
     "needs page size 1 on fa3"),
    (H100, GQA, {"speculative_topk": 2, "page_size": 16}, {"attention_backend": "aiter"}, True, "needs ROCm"),
    (H100, GQA, {}, {"attention_backend": "fa3"}, False, "not implemented in attnserve"),
    (CPU, GQA, {}, {"attention_backend": "flashinfer"}, False, "needs CUDA (this is cpu)"),
    (dataclasses.replace(H100, installed=frozenset({"torch"})), GQA, {}, {"attention_backend": "flashinfer"},
     False, "package 'flashinfer' is not installed"),
]


@pytest.mark.parametrize("hw,model,serving,request_kw,sglang,words", ERRORS)
def test_impossible_explicit_choice_fails_with_reason_and_alternatives(hw, model, serving, request_kw, sglang, words):
    with pytest.raises(ValueError) as info:
        select_backends(hw, model, ServingFeatures(**serving), sglang=sglang, **request_kw)
    msg = str(info.value)
    assert words in msg
    assert "Backends that would:" in msg
    alternatives = msg.split("Backends that would:")[1].strip(" .").split(", ")
    side = "decode" if "decode_backend" in request_kw else "prefill"
    serving_obj = ServingFeatures(**serving)
    for name in alternatives:
        if name != "none":  # every backend offered instead passes every check on that side
            page = serving_obj.page_size or selection.PREFERRED_PAGE_SIZE.get(name, 1)
            assert not selection.problems(name, hw, model, serving_obj, side, page, sglang), name


def test_alternatives_offered_are_runnable():
    with pytest.raises(ValueError) as info:
        select_backends(L4, SINKS, attention_backend="flashinfer")
    alternatives = str(info.value).split("Backends that would:")[1]
    assert "torch_native" in alternatives and "flashinfer" not in alternatives


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: .*flashinfer"):
        select_backends(H100, GQA, attention_backend="flashattention9")


def test_explicit_choice_is_kept_and_recorded():
    sel = select_backends(H100, GQA, attention_backend="flex_attention")
    assert (sel.prefill_backend, sel.decode_backend) == ("flex_attention", "flex_attention")
    assert [e.kind for e in sel.trace if e.backend == "flex_attention"][:2] == ["explicit", "explicit"]


def test_aliases_resolve():
    sel = select_backends(PRESET_HARDWARE["b200"], MLA, attention_backend="nsa", sglang=True)
    assert sel.prefill_backend == "dsa"


def test_side_flags_override_attention_backend_and_make_a_hybrid():
    sel = select_backends(H100, GQA, attention_backend="flashinfer", decode_backend="torch_native")
    assert (sel.prefill_backend, sel.decode_backend) == ("flashinfer", "torch_native")
    assert sel.is_hybrid and not sel.cuda_graph
    assert any("hybrid" in e.reason for e in sel.trace)


def test_one_side_explicit_other_side_default():
    sel = select_backends(H100, GQA, prefill_backend="flex_attention")
    default = select_backends(H100, GQA)  # the H100's measured order: Triton decode (kernels-race-h100-2.json)
    assert sel.prefill_backend == "flex_attention" and sel.decode_backend == default.decode_backend == "triton"


def test_no_backend_at_all_is_an_error_naming_what_was_tried():
    hw = dataclasses.replace(PRESET_HARDWARE["mi300"], installed=frozenset({"torch"}))
    with pytest.raises(ValueError, match="no attention backend can serve prefill.*aiter"):
        select_backends(hw, GQA)


# ---- the trace ------------------------------------------------------------------------------------------
def test_trace_shape():
    sel = select_backends(PRESET_HARDWARE["h100"], GQA)
    kinds = [e.kind for e in sel.trace]
    assert kinds[:4] == ["input"] * 4
    assert kinds.count("policy") == 1 and sel.trace[kinds.index("policy")].backend == sel.policy_choice == "fa3"
    for side, chosen in (("prefill", sel.prefill_backend), ("decode", sel.decode_backend)):
        entries = [e for e in sel.trace if e.side == side and e.kind in ("reject", "accept", "explicit")]
        assert entries[-1].kind == "accept" and entries[-1].backend == chosen
        assert all(e.kind == "reject" and e.reason for e in entries[:-1])
        assert entries[0].backend == "fa3"  # the policy's choice is tried first


def test_trace_serialises():
    sel = select_backends(PRESET_HARDWARE["l4"], SINKS, sglang=True)
    data = json.loads(json.dumps(sel.to_dict()))
    assert set(data) >= {"prefill_backend", "decode_backend", "trace", "page_size", "cuda_graph", "policy_choice"}
    assert all(set(e) == {"kind", "side", "backend", "reason"} for e in data["trace"])
    entry = TraceEntry("reject", "no attention sinks", "flashinfer", "decode")
    assert str(entry).split() == ["reject", "[decode]", "flashinfer:", "no", "attention", "sinks"]
    assert "prefill: triton" in sel.describe()


def test_speculative_verify_side_is_recorded():
    serving = ServingFeatures(speculative_topk=1)
    sel = select_backends(H100, GQA, serving, prefill_backend="flashinfer", decode_backend="torch_native",
                          speculative_attention_mode="decode")
    (entry,) = [e for e in sel.trace if "speculative verify" in e.reason]
    assert entry.backend == "torch_native"
    with pytest.raises(ValueError, match="speculative_attention_mode"):
        select_backends(H100, GQA, serving, speculative_attention_mode="verify")
