"""The kernel plan: which kernel a backend runs for a layer signature, resolved once and named in the trace."""

import dataclasses

import pytest
import torch
from attention_helpers import run_layer

from attnserve.attention.backends.triton import TritonMHABackend, TritonMLABackend
from attnserve.attention.kernels import plan as kplan
from attnserve.attention.kernels import resolve
from attnserve.attention.kernels.gpu_target import GpuTarget
from attnserve.attention.kernels.mla.decode_table import MLADecodeConfig
from attnserve.attention.kernels.split_plan import SplitPolicy
from attnserve.batch import ForwardMode
from attnserve.choice.registry import backend_for_pool, get_spec
from attnserve.choice.selection import ServingFeatures, select_backends
from attnserve.hardware import PRESET_HARDWARE
from attnserve.models.config import ModelConfig
from attnserve.reference.synthetic import make_batch
from attnserve.shape import GENERIC_GQA

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DSV3 = ModelConfig.load("deepseek-v3").attention_shape("deepseek-v3")
DSV2_LITE = ModelConfig.load("deepseek-v2-lite").attention_shape("deepseek-v2-lite")


def kernel_lines(selection):
    return [e.reason for e in selection.trace if e.kind == "kernel"]


@pytest.mark.parametrize("model,page_size,kv_dtype,decode", [
    (DSV3, 64, "bf16", "triton -> gluon scorer (sm90, 128 heads, page 64)"),
    (DSV3, 1, "bf16", "triton -> gluon scorer (sm90, 128 heads, page 1)"),
    (DSV3, 64, "fp8_e4m3", "triton -> triton (sm90, 128 heads, page 64)"),
    (DSV2_LITE, 64, "bf16", "triton -> gluon narrow (sm90, 16 heads, page 64)"),
    (GENERIC_GQA, 16, "bf16", "triton -> triton (sm90, 32 heads / 8 KV, page 16)"),
])
def test_select_names_the_kernel_without_a_gpu(model, page_size, kv_dtype, decode):
    """`attnserve select` (and the engine's start-up log, which prints the trace) names the kernel the chosen
    backend runs: the decode table's Gluon kernel on an H200, the Triton one where the Gluon kernels cannot
    take the shape (an FP8 latent)."""
    sel = select_backends(PRESET_HARDWARE["h200"], model,
                          ServingFeatures(page_size=page_size, kv_cache_dtype=kv_dtype), attention_backend="triton")
    assert f"decode: {decode}" in kernel_lines(sel)
    assert f"decode: {decode}" in sel.describe()


def test_the_prefill_kernel_follows_the_shape():
    h200 = PRESET_HARDWARE["h200"]
    assert resolve.describe_kernels("triton", "prefill", h200, GENERIC_GQA, 1, "bf16").startswith(
        "triton -> prefill_tma (sm90")
    assert "not prefill_tma: KV dtype" in resolve.describe_kernels("triton", "prefill", h200, GENERIC_GQA, 1,
                                                                 "fp8_e4m3")
    rows = resolve.describe_kernels("triton", "prefill", h200, DSV2_LITE, 64, "bf16")
    assert rows.startswith("triton -> gluon seesaw (sm90, 16 heads, page 64) (extend as decode rows, 4 tokens")
    a100 = resolve.describe_kernels("triton", "prefill", PRESET_HARDWARE["a100"], DSV3, 1, "bf16")
    assert "triton mla extend (sm80" in a100 and "Hopper" in a100


def test_on_a_cpu_the_kernel_is_the_interpreter_or_torch():
    cpu = PRESET_HARDWARE["cpu"]
    assert resolve.describe_kernels("triton", "decode", cpu, DSV3, 1, "fp32") == "triton -> interpreter"
    assert resolve.describe_kernels("torch_native", "decode", cpu, DSV3, 1, "fp32") == "torch_native -> torch"
    assert resolve.describe_kernels("flashinfer", "decode", cpu, DSV3, 1, "fp32") is None
    sel = select_backends(cpu, GENERIC_GQA, ServingFeatures(kv_cache_dtype="fp32"))
    assert "decode: torch_native -> torch" in kernel_lines(sel)


def test_a_plan_records_its_kernel_tile_split_policy_partials_and_reason():
    h200 = GpuTarget.of((9, 0))
    sig = kplan.LayerSignature.of_gpu(h200, family="mla", num_heads=128, num_kv_heads=1, head_dim=576,
                                      v_head_dim=512, page_size=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                      kv_lora_rank=512)
    plan = resolve.plan_mla_decode(sig, SplitPolicy(num_sms=132))
    assert dataclasses.is_dataclass(plan) and plan.kernel == "gluon_scorer" and plan.is_gluon
    assert (plan.config.block_h, plan.partials, plan.programs_per_split) == (64, "float16", 2)
    assert plan.split_policy.waves == 0.5 and "decode table" in plan.reason
    assert resolve.plan_mla_decode(sig, SplitPolicy(waves=3.0), waves_given=True).split_policy.waves == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.kernel = "triton"
    rows, tokens, why = resolve.plan_mla_extend_rows(sig, SplitPolicy(), plan, None, False)
    assert (rows.kernel, tokens, why, rows.split_policy.waves) == ("gluon_seesaw", 1, None, 1.0)
    assert resolve.plan_mla_extend_rows(sig, SplitPolicy(), plan, False, False)[2] == "decode rows off"
    assert resolve.plan_mla_extend_rows(sig, SplitPolicy(), plan, None, True)[2] == "an extend tile was given"


def test_the_registry_name_builds_the_class_that_fits_the_pool():
    mha = make_batch([5, 9], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32, device=DEVICE)
    mla = make_batch([5, 9], [1, 1], num_heads=16, mla=(32, 16), device=DEVICE)
    assert type(backend_for_pool("triton", mha.pool)) is TritonMHABackend
    assert type(backend_for_pool("triton", mla.pool)) is TritonMLABackend
    assert get_spec("triton").load_class(mha.pool) is TritonMHABackend
    assert get_spec("triton").load_class(mla.pool) is TritonMLABackend
    assert TritonMLABackend.features.expanded_mla_prefill and not TritonMHABackend.features.expanded_mla_prefill
    with pytest.raises(ValueError, match="takes TritonMLABackend"):
        TritonMHABackend(mla.pool)
    with pytest.raises(ValueError, match="takes TritonMHABackend"):
        TritonMLABackend(mha.pool)


def test_the_mla_decode_plan_is_resolved_once_per_signature():
    """Every layer of a signature shares one plan object; the interpreter's tile, named as such."""
    sb = make_batch([40, 9], [1, 1], num_heads=16, mla=(32, 16), page_size=4, dtype=torch.bfloat16, device=DEVICE,
                    mode=ForwardMode.DECODE)
    backend = backend_for_pool("triton", sb.pool, num_sms=8, min_split_tokens=16)
    run_layer(sb, backend)
    first = backend.decode_plan(16, torch.bfloat16)
    run_layer(sb, backend)
    assert backend.decode_plan(16, torch.bfloat16) is first and backend.kernel_plans() == [first]
    if DEVICE == "cpu":  # on a GPU the table's tile for its architecture
        assert first.describe() == "interpreter" and first.kernel == "triton"
        assert first.config == MLADecodeConfig(16, 16, 4, 1) and first.programs_per_split == 1
