"""Model presets as Hugging Face `config.json` dicts, and loading one (or a real `config.json`) by name.

The calculator, backend selection and the model code all start from the same
config dict, parsed once by `models.config.ModelConfig`, so a preset name and a
real checkpoint's `config.json` are interchangeable everywhere. Values are those
of the published configs on the Hugging Face Hub (the repo is kept in `_name_or_path`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

_LLAMA3_ROPE_SCALING_405B = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _llama(name_or_path: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "_name_or_path": name_or_path,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-05,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    cfg.update(overrides)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def _deepseek(name_or_path: str, arch: str, model_type: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "_name_or_path": name_or_path,
        "architectures": [arch],
        "model_type": model_type,
        "hidden_act": "silu",
        "attention_bias": False,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "moe_layer_freq": 1,
        "vocab_size": 102400,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-06,
        "torch_dtype": "bfloat16",
        "bos_token_id": 100000,
        "eos_token_id": 100001,
    }
    cfg.update(overrides)
    # the K width attention sees per head (the non-absorbed form); the pool stores the absorbed latent
    cfg.setdefault("head_dim", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    return cfg


def _deepseek_yarn(mscale: float) -> dict[str, Any]:
    """The YaRN RoPE scaling every DeepSeek MLA model publishes (4k trained, 40x); only the mscale differs."""
    return {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale}


def _deepseek_v2(name_or_path: str, **overrides: Any) -> dict[str, Any]:
    """DeepSeek-V2 and V2-Lite share their routing (softmax scores, top-k weights not renormalised) and YaRN."""
    return _deepseek(name_or_path, "DeepseekV2ForCausalLM", "deepseek_v2", **overrides,
                     scoring_func="softmax", norm_topk_prob=False, rope_scaling=_deepseek_yarn(0.707))


PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": _llama(
        "meta-llama/Llama-2-7b-hf",
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, torch_dtype="float16",
    ),
    "llama-2-70b": _llama(
        "meta-llama/Llama-2-70b-hf",
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, torch_dtype="float16",
    ),
    "llama-3-8b": _llama(
        "meta-llama/Meta-Llama-3-8B",
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-3-70b": _llama(
        "meta-llama/Meta-Llama-3-70B",
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # Llama 3 was released at 8B/70B; 405B arrived with Llama 3.1 (128k context, llama3 RoPE scaling)
    "llama-3-405b": _llama(
        "meta-llama/Llama-3.1-405B",
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE_SCALING_405B), bos_token_id=128000, eos_token_id=128001,
    ),
    # v0.1: the release with a 4096-token sliding window
    "mistral-7b": _llama(
        "mistralai/Mistral-7B-v0.1",
        architectures=["MistralForCausalLM"], model_type="mistral",
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
    ),
    "qwen3-8b": _llama(
        "Qwen/Qwen3-8B",
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000, rms_norm_eps=1e-06, use_sliding_window=False, max_window_layers=36,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "smollm2-135m": _llama(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000,
        tie_word_embeddings=True,
    ),
    "deepseek-v2": _deepseek_v2(
        "deepseek-ai/DeepSeek-V2",
        hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=60,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        n_routed_experts=160, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=8, topk_group=3, routed_scaling_factor=16.0,
    ),
    "deepseek-v2-lite": _deepseek_v2(
        "deepseek-ai/DeepSeek-V2-Lite",
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
    ),
    "deepseek-v3": _deepseek(
        "deepseek-ai/DeepSeek-V3", "DeepseekV3ForCausalLM", "deepseek_v3",
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, vocab_size=129280,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
        topk_method="noaux_tc", n_group=8, topk_group=4, routed_scaling_factor=2.5,
        scoring_func="sigmoid", norm_topk_prob=True, num_nextn_predict_layers=1,
        bos_token_id=0, eos_token_id=1,
        rope_scaling=_deepseek_yarn(1.0),
    ),
}

_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads")


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def load_model_config(preset_or_path: str | Path) -> dict[str, Any]:
    """A fresh copy of a preset, or the dict in a HF `config.json` (file, or a directory holding one).

    Multimodal configs that nest the language model under `text_config` are
    flattened to that part, since attention only cares about the text stack.
    """
    key = _normalise(str(preset_or_path))
    if key in PRESETS:
        return copy.deepcopy(PRESETS[key])
    for cfg in PRESETS.values():  # the HF repo id works too
        if _normalise(cfg["_name_or_path"]) == key:
            return copy.deepcopy(cfg)
    path = Path(preset_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model {str(preset_or_path)!r} is neither a preset nor a path to a config.json; "
            f"presets: {', '.join(sorted(PRESETS))}"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")  # noqa: TRY004
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures", [])}
    missing = [k for k in _REQUIRED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; is it a transformer LM config.json?")
    return cfg


__all__ = ["PRESETS", "load_model_config"]
