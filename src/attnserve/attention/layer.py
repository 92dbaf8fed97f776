"""AttentionLayer: the one place a model touches attention.

Models hold one per transformer layer and call it with projected q/k/v; the
layer writes this step's K/V into the pool and hands the rest to the backend
the step runs on, with what that backend planned for the step. Neither is the
model's business: whoever runs the model names both for the call, `with
attention_step(backend, backend.plan(fb)): model(...)` (vLLM's forward context),
so two engines can share one model object and each step finds its own.

A piecewise CUDA graph capture (`engine/piecewise_graph.py`) cuts the model's forward at each attention
call: inside `attention_cut(cut)` every layer hands its q/k/v to `cut` instead of attending, and returns
what `cut` returns.

MLA models may also ask whether the step runs expanded prefill
(`expanded_prefill_applies`) and, when it does, call `forward_expanded`: the
layer hands that only to a backend that declares `features.expanded_mla_prefill`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch import nn

from attnserve.attention.base import AttentionBackend, StepMetadata
from attnserve.batch import ForwardBatch

_RUNNING_ON: contextvars.ContextVar[tuple[AttentionBackend, StepMetadata] | None] = contextvars.ContextVar(
    "attnserve_attention_step", default=None)
# (layer, q, k, v, fb, save_kv, rope) -> o `[T, H * v_head_dim]`: what a layer does instead of attending
AttentionCut = Callable[..., torch.Tensor]
_CUT: contextvars.ContextVar[AttentionCut | None] = contextvars.ContextVar("attnserve_attention_cut", default=None)


@contextlib.contextmanager
def attention_step(backend: AttentionBackend, metadata: StepMetadata) -> Iterator[AttentionBackend]:
    """Every AttentionLayer called inside the block (this thread) runs on `backend`, over `metadata`: what
    `backend.plan(fb)` (or plan_for_capture) returned for the step the block runs."""
    token = _RUNNING_ON.set((backend, metadata))
    try:
        yield backend
    finally:
        _RUNNING_ON.reset(token)


@contextlib.contextmanager
def attention_cut(cut: AttentionCut | None) -> Iterator[None]:
    """Every AttentionLayer called inside the block (this thread) calls `cut(layer, q, k, v, fb, save_kv, rope)`
    instead of attending and returns its result: where a piecewise graph capture ends one piece. None: layers
    attend again (inside an outer cut)."""
    token = _CUT.set(cut)
    try:
        yield
    finally:
        _CUT.reset(token)


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

    @staticmethod
    def _step() -> tuple[AttentionBackend, StepMetadata]:
        running = _RUNNING_ON.get()
        if running is None:
            raise ValueError("no attention backend for this step: run the model inside "
                             "`with attention_step(backend, backend.plan(fb)):` (attnserve.attention.layer)")
        return running

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
        cut = _CUT.get()
        if cut is not None:
            return cut(self, q, k, v, fb, save_kv, rope)
        backend, meta = self._step()
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
        o = backend.forward(q, k, v, self, fb, meta)  # [T, H, v_head_dim]
        return o.reshape(tokens, self.num_heads * self.v_head_dim)

    # ---- expanded MLA prefill -------------------------------------------------------------------------
    def expanded_prefill_applies(self, fb: ForwardBatch) -> bool:
        """Whether this MLA layer's step runs over K/V expanded per head (`forward_expanded`) rather than
        the absorbed latent: the step's backend declares `features.expanded_mla_prefill` and says the
        planned step fits (e.g. fresh prompts only)."""
        if not self.is_mla:
            return False
        if _CUT.get() is not None:
            raise ValueError("an MLA layer's expanded prefill depends on the step: it cannot be cut into graph pieces")
        backend, meta = self._step()
        return backend.features.expanded_mla_prefill and backend.expanded_prefill_applies(fb, meta)

    def forward_expanded(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, latent_row: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """MLA prefill over the latent expanded per head -> o `[T, H * v]`.

        q, k `[T, H, nope + rope]`, v `[T, H, v]`; latent_row `[T, 1, kv_lora_rank + rope]` is what the
        pool stores, written here for the steps that follow (which read it in the absorbed form).
        """
        backend, meta = self._step()
        if not self.is_mla:
            raise ValueError(f"layer {self.layer_id} is not MLA; expanded prefill is an MLA path")
        if not backend.features.expanded_mla_prefill:
            raise ValueError(f"backend {backend.name} does not declare expanded MLA prefill")
        tokens = q.shape[0]
        backend.store_kv(self, fb, latent_row, None)
        o = backend.forward_expanded_prefill(q, k, v, self, fb, meta)  # [T, H, v]
        return o.reshape(tokens, self.num_heads * v.shape[-1])
