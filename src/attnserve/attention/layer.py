"""AttentionLayer: the one place a model touches attention.

Models hold one per transformer layer and call it with projected q/k/v; the
layer writes this step's K/V into the pool and hands the rest to whichever
backend the step was planned with (`fb.attn_backend`).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.attention.base import ForwardBatch


class AttentionLayer(nn.Module):
    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float | None = None,
        v_head_dim: int | None = None,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
        use_sinks: bool = False,
        is_mla: bool = False,
    ):
        """
        sliding_window: a query at position p sees keys at positions > p - sliding_window
            (the window counts the query itself, as in HF configs); None = full attention.
        logit_cap: scores become cap * tanh(scores / cap) after scaling (Gemma-2 style soft-cap).
        use_sinks: a learned per-head logit joins every softmax denominator (GPT-OSS attention sinks).
        is_mla: one shared latent KV head; k is the latent row, v its first v_head_dim columns.
        """
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if is_mla and num_kv_heads != 1:
            raise ValueError(f"MLA uses one shared latent KV head, got num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logit_cap is not None and logit_cap <= 0:
            raise ValueError(f"logit_cap must be > 0 or None, got {logit_cap}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
        self.is_mla = is_mla
        # [num_heads] sink logits, loaded with the model's weights
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if use_sinks else None

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        save_kv: bool = True,
        rope=None,
    ) -> torch.Tensor:
        """q `[T, H*D]` or `[T, H, D]`; k/v likewise with KV heads -> o `[T, H * v_head_dim]`.

        rope: the model's RopeStep when q and k still need rotating; the backend then rotates and
        stores in one call (fused into one kernel where the model and pool allow).
        """
        backend = fb.attn_backend
        if backend is None:
            raise ValueError("ForwardBatch has no attn_backend; plan the step with a backend first")
        tokens = q.shape[0]
        q = q.view(tokens, self.num_heads, self.head_dim)
        if k is not None:
            k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if v is not None:
            v = v.view(tokens, self.num_kv_heads, self.v_head_dim)
        if rope is not None and save_kv and k is not None:
            q, k = backend.rotate_and_store_kv(self, fb, q, k, v, rope)
        elif rope is not None:
            q, k = rope.rotate(q, k)
        elif save_kv and k is not None:
            backend.store_kv(self, fb, k, v)
        o = backend.forward(q, k, v, self, fb)  # [T, H, v_head_dim]
        return o.reshape(tokens, self.num_heads * self.v_head_dim)
