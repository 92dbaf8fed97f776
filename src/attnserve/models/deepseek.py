"""DeepSeek-V2/V3 with multi-head latent attention (MLA) over the latent KV pool.

The pool keeps one row per token: the compressed KV latent c (kv_lora_rank,
normalised) followed by the RoPE'd shared key k_pe (qk_rope_head_dim), and nothing
but the latent is ever stored. Attention runs in the absorbed form:

    score = q_nope . (W_UK c) + q_pe . k_pe = (W_UK^T q_nope) . c + q_pe . k_pe
    out   = W_UV (sum_j p_j c_j)

i.e. each query head is folded through its key up-projection into latent space,
attention is plain MQA against the 576-wide latent (one shared KV head, V = the
first kv_lora_rank columns), and the value up-projection is applied once to the
attended latent. (DeepSeek-V2 paper, section 2.1.2.)

Fresh prompts may instead run expanded, when the step's backend declares
`expanded_mla_prefill` and says the step fits (`AttentionLayer.expanded_prefill_applies`):
the latent is expanded to per-head keys and values, attention runs at the per-head
widths, and the latent row still goes to the pool for the steps that follow.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from attnserve.attention.layer import AttentionLayer
from attnserve.batch import ForwardBatch
from attnserve.distributed.linear import ColumnParallelLinear, RowParallelLinear
from attnserve.models.base import CausalLM
from attnserve.models.config import ModelConfig
from attnserve.models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm, RotaryEmbedding
from attnserve.models.moe import MoE
from attnserve.models.rope import RopeStep, yarn_mscale
from attnserve.models.weights import LLAMA_STACKED, load_named_weights
from attnserve.ops import TORCH_OPS, OpSet


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale(all_dim)^2 when the config scales RoPE that way."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    p = cfg.rope.params
    if cfg.rope.rope_type != "default" and p.get("mscale_all_dim"):
        m = yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale = scale * m * m
    return scale


class MLAttention(nn.Module):
    ops: OpSet = TORCH_OPS  # set for the whole model by use_ops
    # up to this many tokens the op set's mla_absorb_rope does the query absorption too (each of its programs
    # re-reads W_UK per token). Timed at 1, 2, 4 and 8 requests (engine_gpu_profile --fused no-mla_absorb_rope,
    # results/engine_ab_deepseek_absorb_b*-h100.json and engine_ab_deepseek_b1-h200.json): 0.3-1.1 % faster each
    ABSORB_MAX_TOKENS = 8

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        bias = cfg.attention_bias
        heads = cfg.num_heads
        self.q_low_rank = cfg.q_lora_rank is not None
        # the two projections of the hidden state are one GEMM: the query's (q_proj, or q_a_proj for a
        # low-rank query) and the latent's (kv_a_proj_with_mqa); at batch 1 each is a few-microsecond launch.
        # Under tensor parallelism q_proj's heads are split and the latent part is one unit every rank holds
        # whole (the latent is replicated, so every rank stores the whole latent row); q_a_proj is replicated
        latent_width = cfg.kv_lora_rank + self.rope_dim
        if not self.q_low_rank:
            self.q_latent_proj = ColumnParallelLinear(cfg.hidden_size, [heads * qk_dim, latent_width],
                                                      units=[heads, 1], bias=bias, replicable=(1,))
        else:
            self.q_latent_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.q_lora_rank, latent_width], bias=bias,
                                                      replicate=True)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [heads * qk_dim], units=[heads])
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, [heads * (self.nope_dim + self.v_dim)], units=[heads])
        self.o_proj = RowParallelLinear(heads * self.v_dim, cfg.hidden_size, units=heads, bias=bias)
        self.num_heads = self.kv_b_proj.out_features // (self.nope_dim + self.v_dim)  # this rank's heads
        self.rotary = rotary
        self.attn = AttentionLayer(
            layer_id,
            self.num_heads,
            1,
            cfg.kv_lora_rank + self.rope_dim,
            scaling=mla_softmax_scale(cfg),
            v_head_dim=cfg.kv_lora_rank,
            is_mla=True,
        )

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]) as views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, rope: RopeStep) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, latent_row = self.q_latent_proj(hidden).split(self.q_latent_proj.output_sizes, dim=-1)  # views
        if self.q_low_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, nope + rope]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = latent_row.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [T, rank], [T, rope]
        w_uk, w_uv = self._up_projections()
        expanded = self.attn.expanded_prefill_applies(fb)
        if self.ops.mla_absorb_rope is not None and not expanded and tokens <= self.ABSORB_MAX_TOKENS:
            q_full, kv_row = self.ops.mla_absorb_rope(q_nope, q_pe, w_uk, latent, k_pe, self.kv_a_layernorm.weight,
                                                      self.kv_a_layernorm.eps, rope.cos, rope.sin,
                                                      rope.rotary.interleaved)
        elif self.ops.mla_rope is not None and not expanded:  # norm, RoPE and both concatenations in one launch
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
            q_full, kv_row = self.ops.mla_rope(q_latent, q_pe, latent, k_pe, self.kv_a_layernorm.weight,
                                               self.kv_a_layernorm.eps, rope.cos, rope.sin, rope.rotary.interleaved)
        else:
            latent = self.kv_a_layernorm(latent)  # [T, rank]
            # the latent row is [latent, k_pe]: the layer stores the row
            q_pe, k_pe = rope.rotate(q_pe, k_pe.view(tokens, 1, self.rope_dim))
            if expanded:
                return self._forward_expanded(q_nope, q_pe, latent, k_pe, w_uk, w_uv, fb)
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
            q_full = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, rank + rope]
            kv_row = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, rank + rope]: what the pool stores
        o = self.attn(q_full, kv_row, kv_row[..., : self.kv_lora_rank], fb)  # [T, H * rank]
        o = o.view(tokens, self.num_heads, self.kv_lora_rank).transpose(0, 1)  # [H, T, rank]
        out = o.new_empty(tokens, self.num_heads, self.v_dim)  # [T, H, v]: o_proj reads it as it lies
        torch.bmm(o, w_uv.transpose(1, 2), out=out.transpose(0, 1))  # cuBLAS writes through the strides
        return self.o_proj(out.view(tokens, self.num_heads * self.v_dim))

    def _forward_expanded(self, q_nope, q_pe, latent, k_pe, w_uk, w_uv, fb: ForwardBatch) -> torch.Tensor:
        """Fresh prompts, where the step's backend declares it: the latent expanded to per-head keys
        (nope + rope) and values, so attention runs at the per-head widths (192 / 128 for DeepSeek-V3)
        instead of the latent's (576 / 512). The pool still gets the latent row, which later steps read
        in the absorbed form."""
        tokens = latent.shape[0]
        kv_row = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, rank + rope]: what the pool stores
        k_nope = torch.einsum("tr,hnr->thn", latent, w_uk)  # [T, H, nope]
        v = torch.einsum("tr,hvr->thv", latent, w_uv)  # [T, H, v]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, nope + rope]
        k = torch.cat((k_nope, k_pe.expand(tokens, self.num_heads, self.rope_dim)), dim=-1)  # [T, H, nope + rope]
        o = self.attn.forward_expanded(q, k, v, kv_row, fb)  # [T, H * v]
        return self.o_proj(o)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_id, rotary)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_id) else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# the checkpoint's projections of the hidden state -> (part of q_latent_proj)
_HIDDEN_DOWN = re.compile(r"^(.*\.self_attn)\.(q_proj|q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$")


def _zero_q_proj_bias(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig):
    """The checkpoint's tensors, plus a zero bias for q_proj beside each latent bias: with attention_bias and a
    full-rank query, the latent projection has a bias and q_proj none, but the merged projection has one."""
    for name, tensor in weights:
        yield name, tensor
        if name.endswith(".self_attn.kv_a_proj_with_mqa.bias"):
            qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            yield name.replace("kv_a_proj_with_mqa", "q_proj"), torch.zeros(cfg.num_heads * qk_dim)


class DeepseekForCausalLM(CausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the config picks routing and RoPE layout)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope, cfg.max_position_embeddings,
                                 interleaved=cfg.rope_interleave)
        self._build_stack(cfg, rotary, DeepseekDecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        tied = self.config.tie_word_embeddings
        num_layers = self.config.num_layers

        def rename(name: str):
            if tied and name == "lm_head.weight":
                return None
            name = name.removeprefix("model.")
            if name.startswith("layers."):
                layer = int(name.split(".")[1])
                if layer >= num_layers:  # V3 checkpoints append multi-token-prediction layers
                    return None
            m = _HIDDEN_DOWN.match(name)
            if m:
                return f"{m.group(1)}.q_latent_proj.{m.group(3)}", int(m.group(2) == "kv_a_proj_with_mqa")
            m = _EXPERT.match(name)
            if m:
                prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
                if which == "down_proj":
                    return f"{prefix}.down_proj", expert
                return f"{prefix}.gate_up_proj", 2 * expert + (which == "up_proj")
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                return name, -1
            return name

        if self.config.attention_bias and self.config.q_lora_rank is None:
            weights = _zero_q_proj_bias(weights, self.config)
        load_named_weights(self, weights, LLAMA_STACKED, source, rename)
