"""The Llama family: Llama 2/3, Mistral (sliding window), SmolLM2, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm).

One definition covers them; the config says which variant. Attention itself is
the shared AttentionLayer, so every backend serves every member of the family.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from attnserve.attention.layer import AttentionLayer
from attnserve.batch import ForwardBatch
from attnserve.distributed.linear import ColumnParallelLinear, RowParallelLinear
from attnserve.models.base import CausalLM
from attnserve.models.config import ModelConfig
from attnserve.models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm, RotaryEmbedding
from attnserve.models.rope import RopeStep
from attnserve.models.weights import LLAMA_STACKED, load_named_weights


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        d = cfg.head_dim
        # this rank's query and KV heads (KV heads replicated when tp exceeds them): see distributed.shard
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d],
            units=[cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], replicable=(1, 2), bias=cfg.attention_bias,
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, units=cfg.num_heads, bias=cfg.o_proj_bias)
        self.q_size, self.kv_size = self.qkv_proj.output_sizes[:2]
        self.num_heads = self.q_size // d
        self.num_kv_heads = self.kv_size // d
        self.head_dim = d
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = AttentionLayer(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            d,
            scaling=d**-0.5,
            sliding_window=cfg.sliding_windows[layer_id] if cfg.sliding_windows else None,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, rope: RopeStep) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not fb.mode.is_decode:
            v = v.contiguous()  # extend backends may read the new v directly; decode reads only the pool
        o = self.attn(q, k, v, fb, rope=rope)  # RoPE, K/V store and attention: [T, Hq * D]
        return self.o_proj(o)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self._build_stack(cfg, RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings), LlamaDecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            if tied and name == "lm_head.weight":
                return None  # shares the embedding
            return name.removeprefix("model.")

        load_named_weights(self, weights, LLAMA_STACKED, source, rename)
