"""Models with the fused ops on and off: the same greedy tokens, close logits, no leaked pages.

On the CPU the engine picks the torch ops; these tests put the Triton op set on the model
by hand (it runs under the interpreter, in float32) to exercise the fused path the GPU runs
(on a CUDA machine they run on the GPU, where the engine picks that set itself):
residual carried into add + RMSNorm, SiLU x up, and RoPE fused with the K/V store through
the backend's rotate_and_store_kv. Qwen3 (q/k norms on `[T, H, D]`) covers the other
Llama-family path; DeepSeek covers MLA, whose RoPE stays unfused.
"""

import pytest
import torch
from attention_helpers import rel_err
from engine_helpers import VOCAB, prompts, tiny_llama, tiny_model
from test_engine_models import CONFIGS

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.models.layers import use_ops
from attnserve.ops import TORCH_OPS, select_ops, triton_ops

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
}
PROMPTS = prompts(2, seed=5, shared_prefix=4, lo=3, hi=10)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton kernels under the interpreter


def _run(bundle, fused: bool, **kw):
    """Greedy outputs, every step's logits, and the engine (pages checked) with the chosen op set."""
    bundle.model.to(DEVICE)
    cfg = {"device": DEVICE, "attention_backend": "torch_native", "max_total_tokens": 512,
           "chunked_prefill_size": 8, "page_size": 4, "disable_fused_ops": not fused, **kw}
    engine = Engine(EngineConfig(**cfg), loaded=bundle)
    if fused:
        use_ops(bundle.model, triton_ops())  # the CPU picked torch ops; run the GPU's kernels here
    logits = []
    plain = engine.runner.forward
    engine.runner.forward = lambda batch: logits.append(plain(batch)) or logits[-1]
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in PROMPTS]
    engine.run_until_done()
    assert engine.pages_leaked() == 0
    use_ops(bundle.model, TORCH_OPS)
    return [r.output_ids for r in reqs], logits


@pytest.mark.parametrize("name", ["llama", "qwen3", "deepseek-v2-mla-moe"])
def test_greedy_outputs_identical_with_fused_ops_on_and_off(name):
    bundle = {"llama": lambda: tiny_llama(seed=2), "qwen3": lambda: tiny_model(QWEN3, seed=2)}.get(
        name, lambda: tiny_model(CONFIGS[name], seed=2))()
    out_off, logits_off = _run(bundle, fused=False)
    out_on, logits_on = _run(bundle, fused=True)
    assert out_on == out_off
    assert len(logits_on) == len(logits_off)
    for a, b in zip(logits_on, logits_off):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("kv_dtype,fused_calls", [("auto", True), ("fp8_e4m3", False)])
def test_fused_rope_store_is_used_unless_the_pool_quantises(kv_dtype, fused_calls):
    """FP8 pools quantise in one place (the store kernel): the fused rope+store must not bypass it."""
    bundle = tiny_llama(seed=6)
    calls = []
    fused = triton_ops()
    counting = type(fused)("triton", fused.rmsnorm, fused.add_rmsnorm, fused.silu_mul,
                           lambda *a, **k: calls.append(1) or fused.rope_store(*a, **k))
    bundle.model.to(DEVICE)
    engine = Engine(EngineConfig(device=DEVICE, attention_backend="torch_native", max_total_tokens=256,
                                 kv_cache_dtype=kv_dtype, disable_cuda_graph=True), loaded=bundle)
    use_ops(bundle.model, counting)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.run_until_done()
    use_ops(bundle.model, TORCH_OPS)
    assert engine.parts.kv.pool.is_fp8 == (kv_dtype != "auto")
    assert bool(calls) == fused_calls  # one call per layer per step when it applies
    assert len(calls) in (0, 2 * 2)  # 2 layers x 2 steps


def test_engine_picks_ops_by_device_dtype_and_flag():
    from attnserve.ops import cpu

    assert select_ops("cpu").name == "cpu" and select_ops("cpu").rmsnorm is cpu.rmsnorm  # one-kernel RMSNorm
    assert select_ops("cpu", fused=False).rmsnorm is TORCH_OPS.rmsnorm
    assert select_ops(torch.device("cuda"), fused=False) is TORCH_OPS
    assert select_ops("cuda").name == "triton"  # triton is installed with the test extras
    assert not select_ops("cuda", dtype=torch.float32).split_gate_up  # merged GEMMs on GPUs
    assert select_ops("cpu", dtype=torch.float32).split_gate_up  # fp32 CPU GEMMs: two halves measured faster
    assert not select_ops("cpu", dtype=torch.bfloat16).split_gate_up
    engine = Engine(EngineConfig(device="cpu", attention_backend="torch_native", max_total_tokens=256,
                                 disable_fused_ops=True), loaded=tiny_llama(seed=1))
    assert engine.parts.model.module.layers[0].mlp.ops.split_gate_up
    assert "fused ops: off (unfused torch ops; gate/up as two GEMMs)" in engine.parts.startup_lines


def test_split_gate_up_computes_the_merged_mlp():
    from attnserve.models.layers import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(32, 48, bias=True)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 32)  # [T, hidden]
    merged = mlp(x)
    mlp.ops = select_ops("cpu", dtype=torch.float32)
    assert rel_err(mlp(x), merged) < 1e-6


def test_deepseek_layers_run_the_mla_and_routing_kernels(monkeypatch):
    """DeepSeek's MLA layers hand their latent norm, RoPE and concatenations to the op set's mla_rope (with the
    query absorption, mla_absorb_rope, up to ABSORB_MAX_TOKENS tokens), and its (greedy) routers their top-k to
    moe_route; greedy tokens as with all unfused."""
    import dataclasses

    import test_ops_fused_model as this

    from attnserve.models.deepseek import MLAttention

    fused = triton_ops()
    calls = {"mla_rope": [], "mla_absorb_rope": [], "moe_route": []}

    def counted(name):
        return lambda *a, **k: calls[name].append(a[0].shape[0]) or getattr(fused, name)(*a, **k)

    counting = dataclasses.replace(fused, **{name: counted(name) for name in calls})
    monkeypatch.setattr(this, "triton_ops", lambda: counting)
    config = CONFIGS["deepseek-v2-mla-moe"]
    assert config.get("topk_method", "greedy") == "greedy"
    bundle = tiny_model(config, seed=3)
    out_off, _ = _run(bundle, fused=False)
    assert not any(calls.values())
    out_on, _ = _run(bundle, fused=True)
    assert out_on == out_off
    layers = config["num_hidden_layers"]
    assert len(calls["mla_absorb_rope"]) >= 3 * layers  # every decode step of every layer (3 decode steps)
    assert all(t <= MLAttention.ABSORB_MAX_TOKENS for t in calls["mla_absorb_rope"])
    assert all(t > MLAttention.ABSORB_MAX_TOKENS for t in calls["mla_rope"])
    assert len(calls["moe_route"]) >= 3  # the MoE layer(s), every decode step
