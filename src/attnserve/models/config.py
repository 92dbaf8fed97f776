"""Model hyper-parameters, read once from an HF-style config dict.

HF config files spell the same facts several ways across versions (``rope_scaling``
vs ``rope_parameters``, ``n_routed_experts`` vs ``num_experts``); everything
downstream reads this one normalised view instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# architecture name (config.json "architectures"[0]) -> model family
LLAMA_ARCHITECTURES = frozenset({
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
})
DEEPSEEK_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
SUPPORTED_ARCHITECTURES = LLAMA_ARCHITECTURES | DEEPSEEK_ARCHITECTURES

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _first(d: dict, *keys, default=None):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


@dataclass
class RopeConfig:
    """Rotary embedding parameters in HF's vocabulary (rope_type: default, linear, dynamic, llama3, yarn)."""

    rope_type: str = "default"
    theta: float = 10000.0
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, mscale, ... as given

    @classmethod
    def from_hf(cls, cfg: dict) -> RopeConfig:
        rope = dict(_first(cfg, "rope_parameters", "rope_scaling", default={}) or {})
        theta = float(_first(rope, "rope_theta", default=_first(cfg, "rope_theta", default=10000.0)))
        rope_type = _first(rope, "rope_type", "type", default="default")
        if rope_type == "mrope":  # multimodal section split; positions are 1-D here
            rope_type = "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        return cls(rope_type=rope_type, theta=theta, params=rope)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (always on in Qwen2)
    o_proj_bias: bool = False  # output projection bias (Llama/Qwen3 `attention_bias`; never in Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_windows: list[int | None] = field(default_factory=list)  # per layer; None = full attention
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # DeepSeek MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DeepSeek MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.architecture in DEEPSEEK_ARCHITECTURES

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % max(self.moe_layer_freq, 1) == 0
        )

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config") -> ModelConfig:
        """Parse an HF config dict; `source` names the file in error messages."""
        arch = architecture_of(cfg, source)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
        except KeyError as exc:
            raise ValueError(f"{source}: missing required field {exc.args[0]!r}") from None
        kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
        eos = _first(cfg, "eos_token_id", default=[])
        eos = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        out = cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(_first(cfg, "intermediate_size", default=4 * hidden)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_first(cfg, "rms_norm_eps", default=1e-6)),
            max_position_embeddings=int(_first(cfg, "max_position_embeddings", default=4096)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(cfg, arch, layers),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            raw=dict(cfg),
        )
        if arch in DEEPSEEK_ARCHITECTURES:
            out.q_lora_rank = cfg.get("q_lora_rank")
            out.kv_lora_rank = int(cfg["kv_lora_rank"])
            out.qk_nope_head_dim = int(cfg["qk_nope_head_dim"])
            out.qk_rope_head_dim = int(cfg["qk_rope_head_dim"])
            out.v_head_dim = int(cfg["v_head_dim"])
            out.rope_interleave = bool(cfg.get("rope_interleave", True)) if arch == "DeepseekV3ForCausalLM" else True
            out.n_routed_experts = int(_first(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0))
            out.n_shared_experts = int(_first(cfg, "n_shared_experts", default=0))
            out.num_experts_per_tok = int(_first(cfg, "num_experts_per_tok", default=0))
            out.moe_intermediate_size = int(_first(cfg, "moe_intermediate_size", default=out.intermediate_size))
            out.first_k_dense_replace = int(_first(cfg, "first_k_dense_replace", default=0))
            out.moe_layer_freq = int(_first(cfg, "moe_layer_freq", default=1))
            out.routed_scaling_factor = float(_first(cfg, "routed_scaling_factor", default=1.0))
            default_method = "noaux_tc" if arch == "DeepseekV3ForCausalLM" else "greedy"
            out.topk_method = str(_first(cfg, "topk_method", default=default_method))
            default_scoring = "sigmoid" if arch == "DeepseekV3ForCausalLM" else "softmax"
            out.scoring_func = str(_first(cfg, "scoring_func", default=default_scoring))
            out.n_group = int(_first(cfg, "n_group", default=1))
            out.topk_group = int(_first(cfg, "topk_group", default=1))
            out.norm_topk_prob = bool(cfg.get("norm_topk_prob", arch == "DeepseekV3ForCausalLM"))
        return out


def architecture_of(cfg: dict, source: str = "config") -> str:
    """The supported architecture a config names, or ValueError listing what is supported."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(str(cfg.get("model_type")))
    if arch not in SUPPORTED_ARCHITECTURES:
        named = arch or f"model_type {cfg.get('model_type')!r}"
        raise ValueError(
            f"{source}: unsupported architecture {named}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return arch


def _sliding_windows(cfg: dict, arch: str, num_layers: int) -> list[int | None]:
    """Per-layer window: Mistral applies `sliding_window` everywhere; Qwen2/3 only with use_sliding_window."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        return [None] * num_layers
    if window is None:
        return [None] * num_layers
    if layer_types and len(layer_types) == num_layers:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first_full = int(cfg.get("max_window_layers", num_layers))
        return [int(window) if i >= first_full else None for i in range(num_layers)]
    return [int(window)] * num_layers
