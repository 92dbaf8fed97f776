"""AttentionShape: the one description of a model's attention that everything below the model reads.

Derived from the parsed config (`models.config.ModelConfig.attention_shape()`), it is
what the KV calculator sizes, what the KV pool is built from (`kvcache.pool.make_pool`)
and what backend selection checks against each backend's features. It sits at the
bottom of the package so that the KV cache and attention layers can read it without
importing the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

ATTENTION_TYPES = ("MHA", "GQA", "MLA")


@dataclass(frozen=True)
class AttentionShape:
    """What the attention layers and the KV cache see of a model.

    For MLA the shape is the absorbed form the pool stores: one latent KV head
    whose K is kv_lora_rank + qk_rope_head_dim wide (576 for DeepSeek) and
    whose V is its first kv_lora_rank (512) columns.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # K width per head
    v_head_dim: int  # V width per head
    attention_type: str  # "MHA", "GQA" or "MLA"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None  # the widest window any layer uses; None: full attention only
    has_sinks: bool = False
    logit_softcap: float | None = None
    num_params: int = 0  # estimated from the config, to size the weights beside the cache
    num_active_params: int = 0  # MoE: what one token uses
    model_type: str = ""  # HF model_type, e.g. "deepseek_v3" (some selection rules name a family)
    name: str = ""  # what logs and traces call the model (a preset name, a path)

    def __post_init__(self):
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type must be MHA, GQA or MLA, got {self.attention_type!r}")
        for what in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "v_head_dim"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} must be >= 1, got {getattr(self, what)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_q_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.is_mla and (self.num_kv_heads != 1 or not self.kv_lora_rank or self.qk_rope_head_dim is None):
            raise ValueError("an MLA shape has one latent KV head and needs kv_lora_rank and qk_rope_head_dim")

    @property
    def is_mla(self) -> bool:
        return self.attention_type == "MLA"

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head (1 for MHA; all heads share the latent for MLA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def kv_widths_differ(self) -> bool:
        """K and V heads of different widths (MLA's V-is-a-view-of-K layout does not count)."""
        return not self.is_mla and self.v_head_dim != self.head_dim

    def per_rank(self, tp_size: int) -> AttentionShape:
        """The shape one tensor-parallel rank sees: query heads split, KV heads split (at least one each);
        MLA's one latent head is replicated. The parameters a rank holds are counted as a 1/tp share
        (the replicated norms and MLA's latent projections are small beside the split matrices)."""
        if tp_size < 1 or self.num_q_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} must be >= 1 and divide {self.num_q_heads} query heads")
        if not self.is_mla and self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            raise ValueError(f"tp_size {tp_size} must divide the {self.num_kv_heads} KV heads or be a multiple of them")
        if tp_size == 1:
            return self
        kv = self.num_kv_heads if self.is_mla else max(1, self.num_kv_heads // tp_size)
        return replace(self, num_q_heads=self.num_q_heads // tp_size, num_kv_heads=kv,
                       num_params=self.num_params // tp_size, num_active_params=self.num_active_params // tp_size)


# what `attnserve select` assumes without --model: a Llama-3-8B-like GQA model
GENERIC_GQA = AttentionShape(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, v_head_dim=128,
                             attention_type="GQA", name="generic")

__all__ = ["ATTENTION_TYPES", "GENERIC_GQA", "AttentionShape"]
