"""A tiny random-weight Llama and prompts for the engine tests (fast on 2 CPU cores, fp32)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine

VOCAB = 512
# a DeepSeek-V2 (MLA over a 32 + 16 latent, MoE of 4 experts) small enough for 2 CPU cores
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
}


@dataclass
class TinyBundle:
    model: torch.nn.Module
    tokenizer: object | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    name: str = "tiny random llama"


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2):
    return tiny_model({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }, seed)


def tiny_model(hf_config: dict, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
               matrix_std: float | None = 0.3) -> TinyBundle:
    """Any supported architecture from an HF-style config, with well-spread random weights.

    The weights are drawn in float32 on the CPU whatever `dtype` and `device` are, so one seed gives the same
    model everywhere; parameters the model keeps in float32 (MoE routing) stay float32. Matrices get
    `matrix_std` (None: 1/sqrt(fan_in), which keeps activations at their scale through wider layers).
    """
    from attnserve.models.config import ModelConfig
    from attnserve.models.loader import build_model

    model = build_model(ModelConfig.from_hf(hf_config), dtype, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name or p.dim() == 1:
                p.fill_(1.0)
            else:
                # large enough that logits are well separated (greedy ties are then vanishingly rare)
                std = 1.0 if "embed" in name else matrix_std or p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return TinyBundle(model.eval())


_MODEL = None


def shared_model() -> TinyBundle:
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_llama()
    return _MODEL


def make_engine(**overrides) -> Engine:
    settings = {"device": "cpu", "max_total_tokens": 4096, "max_running_requests": 32, "chunked_prefill_size": None,
                    "attention_backend": "torch_native"}
    settings.update(overrides)
    return Engine(EngineConfig(**settings), loaded=shared_model())


def prompts(n: int, seed: int = 0, shared_prefix: int = 0, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
