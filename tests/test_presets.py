"""Presets, config loading and the attention shape read from a config."""

import json

import pytest

from attnserve.models.config import ModelConfig
from attnserve.presets import PRESETS, load_model_config

REQUIRED = ["architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
            "rope_theta", "rope_scaling", "tie_word_embeddings", "sliding_window", "rms_norm_eps"]
DEEPSEEK = ["kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
            "first_k_dense_replace"]


def _shape(cfg: dict):
    return ModelConfig.from_hf(cfg).attention_shape()


def test_presets_are_complete_hf_configs():
    expected = {"llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3-405b", "mistral-7b",
                "qwen3-8b", "deepseek-v2", "deepseek-v2-lite", "deepseek-v3", "smollm2-135m"}
    assert set(PRESETS) == expected
    for name, cfg in PRESETS.items():
        keys = REQUIRED + (DEEPSEEK if name.startswith("deepseek") else [])
        assert not [k for k in keys if k not in cfg], name
        assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0


@pytest.mark.parametrize(
    "name,kind,q,kv,k_width,v_width",
    [("llama-2-7b", "MHA", 32, 32, 128, 128), ("llama-3-405b", "GQA", 128, 8, 128, 128),
     ("smollm2-135m", "GQA", 9, 3, 64, 64), ("qwen3-8b", "GQA", 32, 8, 128, 128),
     ("deepseek-v3", "MLA", 128, 1, 576, 512), ("deepseek-v2-lite", "MLA", 16, 1, 576, 512)],
)
def test_attention_shapes(name, kind, q, kv, k_width, v_width):
    s = _shape(load_model_config(name))
    assert (s.attention_type, s.num_q_heads, s.num_kv_heads, s.head_dim, s.v_head_dim) == (kind, q, kv, k_width,
                                                                                           v_width)
    assert s.num_params > 0 and s.num_active_params <= s.num_params
    if kind == "MLA":
        assert (s.kv_lora_rank, s.qk_rope_head_dim) == (512, 64)
        assert s.num_active_params < s.num_params / 4  # MoE: few experts per token


def test_sliding_window_sinks_and_softcap():
    assert _shape(load_model_config("mistral-7b")).sliding_window == 4096
    qwen = dict(load_model_config("qwen3-8b"), sliding_window=4096, use_sliding_window=False)
    assert _shape(qwen).sliding_window is None
    gemma_like = dict(load_model_config("llama-3-8b"), attn_logit_softcapping=50.0, model_type="gemma2")
    assert _shape(gemma_like).logit_softcap == 50.0
    sinks = dict(load_model_config("llama-3-8b"), model_type="gpt_oss")
    assert _shape(sinks).has_sinks


def test_load_returns_a_copy_and_accepts_hf_ids():
    cfg = load_model_config("LLAMA_3_8B")
    cfg["num_hidden_layers"] = 1
    assert PRESETS["llama-3-8b"]["num_hidden_layers"] == 32
    assert load_model_config("deepseek-ai/DeepSeek-V3")["model_type"] == "deepseek_v3"


def test_load_from_a_config_file_and_directory(tmp_path):
    cfg = dict(PRESETS["mistral-7b"], num_hidden_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(tmp_path / "config.json")["num_hidden_layers"] == 3
    assert load_model_config(str(tmp_path))["num_hidden_layers"] == 3
    nested = tmp_path / "vlm"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": cfg}))
    assert load_model_config(nested)["num_hidden_layers"] == 3


def test_bad_model_names_and_files(tmp_path):
    with pytest.raises(ValueError) as info:
        load_model_config("llama-9")
    assert "llama-9" in str(info.value) and "llama-3-8b" in str(info.value) and "deepseek-v3" in str(info.value)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model_config(tmp_path / "list.json")
    (tmp_path / "tok.json").write_text('{"vocab_size": 5}')
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_model_config(tmp_path / "tok.json")
    with pytest.raises(ValueError, match="multiple"):
        _shape(dict(PRESETS["llama-3-8b"], num_key_value_heads=5))


def test_any_lm_config_parses_and_only_building_needs_support(capsys, tmp_path):
    """kv-calc and select read configs attnserve cannot build (here a Mixtral-shaped MoE); the loader refuses them."""
    from attnserve.cli import main

    mixtral = dict(PRESETS["mistral-7b"], architectures=["MixtralForCausalLM"], model_type="mixtral",
                   num_local_experts=8, num_experts_per_tok=2)
    cfg = ModelConfig.from_hf(mixtral)
    assert cfg.n_routed_experts == 8 and cfg.num_params(active_only=True) < cfg.num_params() / 3
    assert cfg.num_params() > 6 * ModelConfig.from_hf(PRESETS["mistral-7b"]).num_params()
    with pytest.raises(ValueError, match="unsupported architecture MixtralForCausalLM"):
        cfg.check_supported()
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    assert main(["kv-calc", "--model", str(tmp_path), "--context", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 128 * 1024


def test_select_feature_flags_take_a_value_or_stand_alone(capsys):
    from attnserve.cli import main

    for argv in (["--sliding-window"], ["--sliding-window", "128"], ["--logit-softcap", "30"]):
        assert main(["select", "--gpu", "l4", "--json", *argv]) == 0
        model_line = json.loads(capsys.readouterr().out)["trace"][1]["reason"]
        assert ("sliding window" in model_line) == ("--sliding-window" in argv), model_line
    with pytest.raises(SystemExit):
        main(["select", "--sliding-window", "0"])
    assert "must be >= 1" in capsys.readouterr().err
