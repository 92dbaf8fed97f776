"""Tiny random checkpoints on disk for the tensor-parallel tests: every rank must read the same weights
(a model in memory cannot be shared with spawned ranks), so the tp 1 model is written out as an HF
directory (config.json + model.safetensors, q/k/v and gate/up as separate tensors, as real checkpoints
keep them) and every tp size loads it from there."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from engine_helpers import VOCAB, tiny_model

TINY_LLAMA_TP = {  # 8 query / 2 KV heads: tp 2 splits both, tp 4 replicates each KV head on two ranks
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
TINY_DEEPSEEK_TP = {  # MLA (q low-rank) + MoE with a shared expert; one dense layer first
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": VOCAB + 2,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 24,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under HF checkpoint names, fused projections split back into their parts."""
    out = {}
    for name, p in model.state_dict().items():
        hf = name if name.startswith("lm_head.") else f"model.{name}"
        parent = name.rsplit(".", 2)[0]
        if ".qkv_proj." in name:
            sizes = model.get_submodule(parent + ".qkv_proj").output_sizes
            for part, t in zip(("q_proj", "k_proj", "v_proj"), p.split(sizes)):
                out[hf.replace("qkv_proj", part)] = t.clone()
        elif ".q_latent_proj." in name:  # MLA's merged query and latent down-projections
            attn = model.get_submodule(parent)
            q_name = "q_a_proj" if attn.q_low_rank else "q_proj"
            for part, t in zip((q_name, "kv_a_proj_with_mqa"), p.split(attn.q_latent_proj.output_sizes)):
                out[hf.replace("q_latent_proj", part)] = t.clone()
        elif ".gate_up_proj." in name and ".experts." not in name:
            gate, up = p.chunk(2)
            out[hf.replace("gate_up_proj", "gate_proj")] = gate.clone()
            out[hf.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            out[hf] = p.clone()
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def write_checkpoint(hf_config: dict, folder: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    model = tiny_model(hf_config, seed).model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    save_file(checkpoint_tensors(model), str(folder / "model.safetensors"))
    return folder


def failing_rank() -> None:
    """A rank's work that raises (what a worker's out-of-memory or bad weight looks like to the launcher)."""
    raise RuntimeError("rank failed on purpose")
