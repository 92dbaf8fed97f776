"""The one parsed model config: every fact any part of attnserve reads from an HF-style config dict.

HF config files spell the same facts several ways across versions (``rope_scaling``
vs ``rope_parameters``, ``n_routed_experts`` vs ``num_experts``); everything
downstream reads this one normalised view instead: the model code its
hyper-parameters, and through `attention_shape()` the KV calculator, the KV pool
and backend selection their `AttentionShape`. `attention_shape_of(model, tp_size)`
is the one way from a model name (a preset, a HF config.json or model directory,
a .gguf file) to the shape one tensor-parallel rank sees: `select`, `kv-calc`,
`tune` and the loaded model's `kv_cache_spec()` all go through it. Any transformer LM config parses
(the calculator sizes models attnserve cannot run); `check_supported` is what the
model builder adds on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnserve.dtypes import GGUF_STATED_DTYPE, stated_dtype
from attnserve.models.gguf_loader import GGUFFile
from attnserve.presets import load_model_config
from attnserve.shape import AttentionShape

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
_ARCH_TO_MODEL_TYPE = {arch: model_type for model_type, arch in _MODEL_TYPE_TO_ARCH.items()}


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
        return cls(rope_type=str(rope_type), theta=theta, params=rope)

    def check_supported(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


@dataclass
class ModelConfig:
    architecture: str  # config.json "architectures"[0] (or the one its model_type names); "" if neither
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
    attention_sinks: bool = False  # a learned per-head logit in every softmax (GPT-OSS)
    logit_softcap: float | None = None  # attention scores soft-capped at this value (Gemma-2)
    model_type: str = ""
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
        """Multi-head latent attention: a compressed KV latent plus a decoupled RoPE key (DeepSeek)."""
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % max(self.moe_layer_freq, 1) == 0
        )

    @classmethod
    def load(cls, preset_or_path: str | Path) -> ModelConfig:
        """A preset name, HF repo id of a preset, a config.json (file or its directory) or a .gguf file, parsed."""
        if str(preset_or_path).endswith(".gguf"):
            path = Path(preset_or_path)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such GGUF file")
            return cls.from_hf(GGUFFile(path).hf_config(), str(path))
        return cls.from_hf(load_model_config(preset_or_path), str(preset_or_path))

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config") -> ModelConfig:
        """Parse an HF config dict; `source` names the file in error messages."""
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
        except KeyError as exc:
            raise ValueError(f"{source}: missing required field {exc.args[0]!r}") from None
        arch = _architecture(cfg)
        model_type = str(cfg.get("model_type") or _ARCH_TO_MODEL_TYPE.get(arch, ""))
        kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
        eos = _first(cfg, "eos_token_id", default=[])
        eos = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        softcap = cfg.get("attn_logit_softcapping")
        out = cls(
            architecture=arch,
            vocab_size=int(_first(cfg, "vocab_size", default=0)),
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
            attention_sinks=model_type == "gpt_oss" or bool(cfg.get("attention_sinks")),
            logit_softcap=float(softcap) if softcap else None,
            model_type=model_type,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            raw=dict(cfg),
        )
        if cfg.get("kv_lora_rank") and "qk_rope_head_dim" in cfg:
            out.q_lora_rank = cfg.get("q_lora_rank")
            out.kv_lora_rank = int(cfg["kv_lora_rank"])
            out.qk_nope_head_dim = int(cfg["qk_nope_head_dim"])
            out.qk_rope_head_dim = int(cfg["qk_rope_head_dim"])
            out.v_head_dim = int(cfg["v_head_dim"])
            out.rope_interleave = bool(cfg.get("rope_interleave", True)) if arch == "DeepseekV3ForCausalLM" else True
        v3 = arch == "DeepseekV3ForCausalLM"
        out.n_routed_experts = int(_first(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0))
        if out.n_routed_experts:
            out.n_shared_experts = int(_first(cfg, "n_shared_experts", default=0))
            out.num_experts_per_tok = int(_first(cfg, "num_experts_per_tok", default=0))
            out.moe_intermediate_size = int(_first(cfg, "moe_intermediate_size", default=out.intermediate_size))
            out.first_k_dense_replace = int(_first(cfg, "first_k_dense_replace", default=0))
            out.moe_layer_freq = int(_first(cfg, "moe_layer_freq", default=1))
            out.routed_scaling_factor = float(_first(cfg, "routed_scaling_factor", default=1.0))
            out.topk_method = str(_first(cfg, "topk_method", default="noaux_tc" if v3 else "greedy"))
            out.scoring_func = str(_first(cfg, "scoring_func", default="sigmoid" if v3 else "softmax"))
            out.n_group = int(_first(cfg, "n_group", default=1))
            out.topk_group = int(_first(cfg, "topk_group", default=1))
            out.norm_topk_prob = bool(cfg.get("norm_topk_prob", v3))
        return out

    def check_supported(self, source: str = "config") -> None:
        """What building the model needs beyond parsing: an architecture, RoPE type and vocabulary we have."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            named = self.architecture or f"model_type {self.raw.get('model_type')!r}"
            raise ValueError(f"{source}: unsupported architecture {named}; "
                             f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        if self.vocab_size < 1:
            raise ValueError(f"{source}: missing required field 'vocab_size'")
        self.rope.check_supported()

    # ---- what the rest of attnserve derives from it ------------------------------------------------
    def attention_shape(self, name: str = "") -> AttentionShape:
        """The shape attention and the KV cache see (MLA in the absorbed form the pool stores)."""
        windows = [w for w in self.sliding_windows if w is not None]
        common = {
            "num_layers": self.num_layers,
            "num_q_heads": self.num_heads,
            "sliding_window": max(windows) if windows else None,
            "has_sinks": self.attention_sinks,
            "logit_softcap": self.logit_softcap,
            "num_params": self.num_params(),
            "num_active_params": self.num_params(active_only=True),
            "model_type": self.model_type,
            "name": name,
        }
        if self.is_mla:
            return AttentionShape(num_kv_heads=1, head_dim=self.kv_lora_rank + self.qk_rope_head_dim,
                                  v_head_dim=self.kv_lora_rank, attention_type="MLA",
                                  kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim, **common)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        v_dim = int(self.raw.get("v_head_dim") or self.head_dim)
        return AttentionShape(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, v_head_dim=v_dim,
                              attention_type="MHA" if self.num_kv_heads == self.num_heads else "GQA", **common)

    def num_params(self, active_only: bool = False) -> int:
        """Parameter count from the config alone (embeddings, attention, MLP/MoE, norms); 0 without a
        vocabulary or MLP size to count from.

        Good to well under 1% for the presets (Llama-2-7B 6.74B, DeepSeek-V3 671B); used to size the
        weights next to the KV cache, not to load anything. With `active_only`, MoE layers count only
        the experts one token uses.
        """
        if not self.vocab_size or "intermediate_size" not in self.raw:
            return 0
        h, layers = self.hidden_size, self.num_layers
        attn = layers * self._attention_params()
        norms = layers * 2 * h + h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + attn + self._mlp_params(active_only) + norms

    def _attention_params(self) -> int:
        """Weights of one attention block (projections, plus MLA's low-rank norms)."""
        h, hq, hkv, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        if self.is_mla:
            rope, nope, v = self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
            q_rank, kv_rank = self.q_lora_rank, self.kv_lora_rank
            q = h * q_rank + q_rank + q_rank * hq * (nope + rope) if q_rank else h * hq * (nope + rope)
            kv = h * (kv_rank + rope) + kv_rank + kv_rank * hq * (nope + v)
            return q + kv + hq * v * h
        bias = (hq + 2 * hkv) * d if self.attention_bias else 0
        qk_norm = 2 * d if self.qk_norm else 0
        return h * d * (2 * hq + 2 * hkv) + bias + qk_norm

    def _mlp_params(self, active_only: bool) -> int:
        """Weights of all MLP blocks (gated: gate, up, down), MoE routed/shared experts counted per layer."""
        h, layers = self.hidden_size, self.num_layers
        dense = 3 * h * self.intermediate_size
        n_routed = self.n_routed_experts
        if not n_routed:
            return layers * dense
        first_dense = self.first_k_dense_replace
        expert = 3 * h * self.moe_intermediate_size
        used = (self.num_experts_per_tok or n_routed) if active_only else n_routed
        moe = (used + self.n_shared_experts) * expert + h * n_routed  # + router
        return first_dense * dense + (layers - first_dense) * moe


def _architecture(cfg: dict) -> str:
    """The architecture a config names, or the one its model_type implies; "" when it says neither."""
    archs = cfg.get("architectures") or []
    return str(archs[0]) if archs else _MODEL_TYPE_TO_ARCH.get(str(cfg.get("model_type")), "")


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


def attention_shape_of(model: str | Path | ModelConfig, tp_size: int = 1, name: str | None = None) -> AttentionShape:
    """The AttentionShape one of `tp_size` tensor-parallel ranks of `model` sees: a preset, a HF config.json
    or model directory, a .gguf file, or a config already parsed. Named `name`, by default as the model is
    given (a parsed config: unnamed)."""
    cfg = model if isinstance(model, ModelConfig) else ModelConfig.load(model)
    if name is None:
        name = "" if isinstance(model, ModelConfig) else str(model)
    return cfg.attention_shape(name=name).per_rank(tp_size)


def stated_dtype_of(model: str | Path | None) -> str | None:
    """The dtype `model` states, which "auto" takes off the CPU (attnserve.dtypes.resolve_dtypes), read as the
    loader reads it: a preset's or config.json's torch_dtype, bf16 for a .gguf file; None for no model (the
    generic shape) or one that states none."""
    if model is None:
        return None
    if str(model).endswith(".gguf"):
        return GGUF_STATED_DTYPE
    return stated_dtype(load_model_config(model))
