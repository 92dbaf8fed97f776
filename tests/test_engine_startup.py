"""Engine start-up decides like `attnserve select`, on the device it was told to use, with the loader's dtype."""

import argparse
import dataclasses
import json

import pytest
import torch
from engine_helpers import make_engine, shared_model, tiny_llama

from attnserve import hardware
from attnserve.choice import registry
from attnserve.commands.select import model_from_args
from attnserve.engine import startup
from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.startup import build_parts, model_shape, resolve_device
from attnserve.models.base import CausalLM
from attnserve.models.config import ModelConfig

GPT_OSS_LIKE = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 128,
    "vocab_size": 512, "intermediate_size": 512,
}
GEMMA2_LIKE = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "attn_logit_softcapping": 50.0,
}


class _Model:
    """What the engine reads of a loaded model's shape, for architectures we parse but cannot build."""

    kv_cache_spec = CausalLM.kv_cache_spec
    tp_size = 1  # built for one rank

    def __init__(self, hf_config: dict):
        self.config = ModelConfig.from_hf(hf_config)


@dataclasses.dataclass
class _Bundle:
    hf_config: dict
    source: str = "test model"

    @property
    def model(self):
        return _Model(self.hf_config)


def _select_traits(cfg: dict, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    args = argparse.Namespace(model=str(path), tp_size=1, attention_sinks=False, sliding_window=None,
                              logit_softcap=None, v_head_dim=None)
    return model_from_args(args)


@pytest.mark.parametrize("cfg", [GPT_OSS_LIKE, GEMMA2_LIKE], ids=["sinks+window", "softcap"])
def test_engine_traits_are_the_select_commands(cfg, tmp_path):
    engine_traits = model_shape(_Bundle(cfg))
    assert dataclasses.replace(engine_traits, name="") == dataclasses.replace(_select_traits(cfg, tmp_path), name="")
    assert engine_traits.model_type == cfg["model_type"]
    assert engine_traits.has_sinks == (cfg["model_type"] == "gpt_oss")
    assert (engine_traits.logit_softcap is not None) == ("attn_logit_softcapping" in cfg)


def test_gguf_config_without_model_type_gets_it_from_the_architecture():
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # what a GGUF file yields
    traits = model_shape(_Bundle(cfg))
    assert traits.model_type == "qwen2"
    assert (traits.num_q_heads, traits.num_kv_heads, traits.head_dim) == (4, 2, 32)


def test_cpu_engine_on_a_gpu_machine_checks_backends_against_the_cpu(monkeypatch):
    monkeypatch.setattr(startup, "detect_hardware", lambda: hardware.PRESET_HARDWARE["h100"])
    seen = []
    real = registry.availability

    def spy(name, hw):
        seen.append(hw.device)
        return real(name, hw)

    monkeypatch.setattr(registry, "availability", spy)
    engine = make_engine(attention_backend=None)
    assert engine.parts.attention.prefill_backend == engine.parts.attention.decode_backend == "torch_native"
    assert seen and set(seen) == {"cpu"}  # building the backend did not detect the (pretend) GPU again


def _small(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", max_total_tokens=64, max_running_requests=2, attention_backend="torch_native",
                        **kw)


def test_dtype_names_are_the_loaders():
    bundle = shared_model()  # float32
    for name in ("auto", "fp32", "float32"):
        assert build_parts(_small(dtype=name), loaded=bundle).model.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        build_parts(_small(dtype="int3"), loaded=bundle)


def test_an_explicit_dtype_the_model_does_not_have_is_an_error_not_ignored():
    """dtype='half' with a float32 model already loaded cannot be honoured: say so, name both dtypes."""
    with pytest.raises(ValueError, match=r"dtype 'half' \(float16\) cannot be honoured.*loaded float32"):
        build_parts(_small(dtype="half"), loaded=shared_model())


def test_an_explicit_dtype_is_what_the_loader_builds(tmp_path):
    """Loading from a path honours the dtype asked for, and start-up says which it is."""
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    parts = build_parts(_small(model=str(tmp_path), dtype="half", random_weights=True))
    assert parts.model.dtype == torch.float16
    assert next(parts.model.module.parameters()).dtype == torch.float16
    assert "dtype: float16" in "\n".join(parts.startup_lines)


def test_setup_steps_hand_the_runner_its_graph_runner():
    engine = make_engine()
    assert engine.parts.graphs.runner is None and engine.parts.graphs.note == "off (CPU)"
    assert engine.runner.graph_runner is engine.parts.graphs.runner
    kv = engine.parts.kv
    assert kv.req_pool.filled(kv.padding_row) == 0 and kv.max_context_len == engine.max_context_len


def test_auto_dtype_is_bf16_on_a_cpu_with_hardware_bf16_and_the_checkpoints_on_a_gpu(monkeypatch):
    from attnserve import hardware
    from attnserve.models.loader import resolve_dtype

    for fast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(hardware, "cpu_has_hardware_bf16", lambda fast=fast: fast)
        assert resolve_dtype("auto", torch.device("cpu"), {"torch_dtype": "float16"}) == expected
    assert resolve_dtype("fp32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), {}) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), {"torch_dtype": "float16"}) == torch.float16


def test_mps_device_is_accepted_and_refused_clearly_without_mps(monkeypatch):
    assert EngineConfig(device="mps").device == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no usable MPS"):
        resolve_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("mps") == torch.device("mps")


def test_startup_log_names_the_weight_format_and_why_the_dtype():
    engine = make_engine()  # the tiny fp32 model: dense weights, dtype given by the bundle
    lines = engine.parts.startup_lines
    assert any(line == "weights: dequantized (float32)" for line in lines), lines
    with pytest.raises(ValueError, match="already packed"):
        make_engine(weights_dtype="int4")  # the shared model's weights are held one way for every engine

    with pytest.raises(ValueError, match="Q4_0/Q4_1"):  # a model without 4-bit GGUF weights
        Engine(EngineConfig(device="cpu", max_total_tokens=64, weights_dtype="int4"), loaded=tiny_llama())
