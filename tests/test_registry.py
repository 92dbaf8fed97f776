"""Registry: every SGLang name, aliases, clear errors, and reasons a backend cannot run."""

import pytest

from attnserve.attention.base import BackendFeatures
from attnserve.choice.registry import (
    ALIASES,
    REGISTRY,
    availability,
    create_backend,
    family_features,
    get_spec,
    hardware_problems,
    resolve_name,
)
from attnserve.hardware import PRESET_HARDWARE, Hardware
from attnserve.kvcache.pool import MHAKVPool, MLAKVPool

# SGLang's --attention-backend choices (v0.5.22 code: 25 names incl. 2 aliases), plus the two its docs
# still list after PR 32114 deleted them
SGLANG_NAMES = [
    "flashinfer", "fa3", "fa4", "trtllm_mha", "trtllm_mla", "flashmla", "cutedsl_mla", "tokenspeed_mla",
    "dsa", "nsa", "dsv4", "compressed", "qsa", "minicpm_flashattn", "minicpm_flashinfer", "triton",
    "torch_native", "flex_attention", "aiter", "wave", "intel_amx", "intel_xpu", "ascend", "hpc_ops",
    "llada2_cfg_flashinfer",
]
DOCS_ONLY = ["cutlass_mla", "dual_chunk_flash_attn"]


def test_every_sglang_name_is_known():
    assert len(SGLANG_NAMES) == 25
    for name in SGLANG_NAMES + DOCS_ONLY:
        assert resolve_name(name) in REGISTRY
    current = [n for n in REGISTRY if not REGISTRY[n].removed] + list(ALIASES)
    assert sorted(current) == sorted(SGLANG_NAMES)
    assert {n for n in REGISTRY if REGISTRY[n].removed} == set(DOCS_ONLY)


def test_aliases_resolve_to_their_targets():
    assert resolve_name("nsa") == "dsa"
    assert resolve_name("compressed") == "dsv4"
    assert get_spec("NSA") is REGISTRY["dsa"]
    assert resolve_name(" Flex-Attention ") == "flex_attention"


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        resolve_name("flash_decoding")
    msg = str(info.value)
    assert "flash_decoding" in msg
    for name in ("torch_native", "triton", "flashinfer", "fa3", "nsa (= dsa)", "compressed (= dsv4)"):
        assert name in msg


def test_implemented_backends_read_features_from_their_class():
    spec = get_spec("torch_native")
    assert spec.implemented
    assert "cpu" in spec.features.devices
    assert availability("torch_native", PRESET_HARDWARE["cpu"]) == []


def test_known_but_unimplemented_backends_say_so():
    spec = get_spec("fa3")
    assert not spec.implemented and not spec.features.implemented
    with pytest.raises(ValueError, match="not implemented"):
        spec.load_class(None)
    assert availability("fa3", PRESET_HARDWARE["h100"]) == ["not implemented in attnserve (known from SGLang)"]
    assert any("removed from SGLang" in r for r in availability("cutlass_mla", PRESET_HARDWARE["b200"]))


@pytest.mark.parametrize(
    "backend,machine,expected",
    [
        ("fa3", "cpu", "needs CUDA"),
        ("fa4", "a100", "needs SM90 (Hopper) or SM100 (Blackwell), this GPU is sm80"),
        ("trtllm_mla", "h100", "SM100"),
        ("flashmla", "a100", "SM90"),
        ("aiter", "h100", "needs ROCm"),
        ("ascend", "mi300", "NPU"),
    ],
)
def test_hardware_reasons(backend, machine, expected):
    reasons = availability(backend, PRESET_HARDWARE[machine])
    assert any(expected in r for r in reasons), reasons


def test_missing_packages_and_minimum_compute_capability():
    features = BackendFeatures(required_packages=("flashinfer",), min_compute_capability=(8, 0))
    old_gpu = Hardware("cuda", "nvidia", "V100", (7, 0), (12, 0), 80, 32, installed=frozenset({"torch"}))
    reasons = hardware_problems(features, old_gpu)
    assert any(">= 8.0" in r and "sm70" in r for r in reasons)
    assert "package 'flashinfer' is not installed" in reasons
    fine = Hardware("cuda", "nvidia", "H100", (9, 0), (12, 8), 132, 80, installed=frozenset({"flashinfer"}))
    assert hardware_problems(features, fine) == []


def test_aiter_runs_on_amd_apart_from_the_implementation():
    assert availability("aiter", PRESET_HARDWARE["mi300"]) == ["not implemented in attnserve (known from SGLang)"]


def test_create_backend_refuses_with_every_reason():
    pool = MHAKVPool(4, 1, 1, 1, 8)
    with pytest.raises(ValueError) as info:
        create_backend("nsa", pool, hw=PRESET_HARDWARE["cpu"])
    msg = str(info.value)
    assert "'dsa'" in msg and "needs CUDA" in msg and "not implemented" in msg
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("nope", pool)


def test_create_backend_builds_the_cpu_default():
    pool = MHAKVPool(4, 1, 1, 1, 8)
    backend = create_backend("torch_native", pool, hw=PRESET_HARDWARE["cpu"])
    assert backend.pool is pool
    assert type(backend).features is get_spec("torch_native").features


# the features each implemented name declared before its MHA and MLA classes were split apart
FLASHINFER_FEATURES = BackendFeatures(
    kv_dtypes=frozenset({"bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}), attention_types=frozenset({"MHA", "GQA", "MLA"}),
    head_dims=(64, 128, 256), sliding_window=True, logit_softcap=True, custom_mask=True, spec_topk1=True,
    spec_topk_gt1=True, spec_topk_gt1_paged=True, cuda_graph=True, devices=frozenset({"cuda"}),
    min_compute_capability=(8, 0), required_packages=("flashinfer",))


def test_a_name_with_two_classes_keeps_its_features():
    assert get_spec("flashinfer").features == FLASHINFER_FEATURES
    assert "MLA" in get_spec("triton").features.attention_types


def test_family_features_union_the_two_classes():
    mha = BackendFeatures(attention_types=frozenset({"MHA", "GQA"}), page_sizes=(1, 16), custom_mask=True,
                          min_compute_capability=(8, 0), required_packages=("a",))
    mla = BackendFeatures(attention_types=frozenset({"MLA"}), page_sizes=(16, 64), expanded_mla_prefill=True,
                          min_compute_capability=(9, 0), required_packages=("a", "b"))
    both = family_features(mha, mla)
    assert both.attention_types == {"MHA", "GQA", "MLA"} and both.page_sizes == (1, 16, 64)
    assert both.custom_mask and both.expanded_mla_prefill
    assert both.min_compute_capability == (8, 0) and both.required_packages == ("a", "b")
    assert family_features(mha, BackendFeatures(page_sizes=None)).page_sizes is None  # None: any page size
    assert family_features(BackendFeatures(), BackendFeatures()) == BackendFeatures()


def test_load_class_picks_by_pool():
    spec = get_spec("torch_native")
    assert spec.load_class(MHAKVPool(4, 1, 1, 1, 8)) is spec.load_class(MLAKVPool(4, 1, 1, 8, 4))
