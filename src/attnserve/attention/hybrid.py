"""One backend object over two: prefill-like steps go to one backend, decode steps to another.

Why: the best prefill kernel and the best decode kernel are often different
(compute-bound vs bandwidth-bound), and SGLang's `--prefill-attention-backend` /
`--decode-attention-backend` exist for that. Both backends read and write the
same pool, so routing a step is all there is to it:

- DECODE and IDLE -> the decode backend (and so do decode CUDA graphs);
- EXTEND and MIXED -> the prefill backend;
- TARGET_VERIFY -> the prefill backend, or the decode backend with
  `speculative_attention_mode="decode"` (SGLang's `--speculative-attention-mode`).
"""

from __future__ import annotations

import dataclasses

from attnserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode

SPECULATIVE_ATTENTION_MODES = ("prefill", "decode")


class HybridAttentionBackend(AttentionBackend):
    name = "hybrid"

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend, speculative_attention_mode: str = "prefill"):
        if speculative_attention_mode not in SPECULATIVE_ATTENTION_MODES:
            raise ValueError(f"speculative_attention_mode must be one of {SPECULATIVE_ATTENTION_MODES}, "
                             f"got {speculative_attention_mode!r}")
        if prefill.pool is not decode.pool:
            raise ValueError("prefill and decode backends must share one KV pool")
        super().__init__(prefill.pool)
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.speculative_attention_mode = speculative_attention_mode
        self.name = f"hybrid(prefill={prefill.name}, decode={decode.name})"
        # what the pair can do: prefill traits from one, decode traits (and CUDA graphs) from the other
        pf, df = prefill.features, decode.features
        self.features = dataclasses.replace(df, prefill=pf.prefill, decode=df.decode,
                                            custom_mask=(pf if speculative_attention_mode == "prefill" else df).custom_mask)
        self._active: AttentionBackend = prefill

    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
            return self.decode_backend
        if mode is ForwardMode.TARGET_VERIFY and self.speculative_attention_mode == "decode":
            return self.decode_backend
        return self.prefill_backend

    # ---- per step: plan once on the backend that serves this mode ---------------------------------------
    def plan(self, fb: ForwardBatch) -> None:
        self._active = self.backend_for(fb.mode)
        self._active.plan(fb)

    def store_kv(self, layer, fb: ForwardBatch, k, v) -> None:
        self.backend_for(fb.mode).store_kv(layer, fb, k, v)

    def rotate_and_store_kv(self, layer, fb: ForwardBatch, q, k, v, rope):
        return self.backend_for(fb.mode).rotate_and_store_kv(layer, fb, q, k, v, rope)

    def forward(self, q, k, v, layer, fb: ForwardBatch):
        return self.backend_for(fb.mode).forward(q, k, v, layer, fb)

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch):
        return self.backend_for(fb.mode).forward_extend(q, k, v, layer, fb)

    def forward_decode(self, q, layer, fb: ForwardBatch):
        return self.backend_for(fb.mode).forward_decode(q, layer, fb)

    # ---- CUDA graphs: decode graphs belong to the decode backend; verify graphs to whichever serves verify ----
    def init_graph_buffers(self, max_bs: int, max_tokens: int) -> None:
        self.graph_max_bs = max_bs
        self.decode_backend.init_graph_buffers(max_bs, max_tokens)
        verify = self.backend_for(ForwardMode.TARGET_VERIFY)
        if verify is not self.decode_backend and verify.features.cuda_graph:
            verify.init_graph_buffers(max_bs, max_tokens)

    def plan_for_capture(self, fb: ForwardBatch) -> None:
        self._active = self.backend_for(fb.mode)
        self._active.plan_for_capture(fb)

    def plan_for_replay(self, fb: ForwardBatch) -> None:
        self._active = self.backend_for(fb.mode)
        self._active.plan_for_replay(fb)


HybridBackend = HybridAttentionBackend  # the shorter name the engine uses


def build_backend(selection, pool, hw=None, speculative_attention_mode: str = "prefill", **options) -> AttentionBackend:
    """Instantiate what a Selection names: one backend, or a hybrid when prefill and decode differ."""
    from attnserve.attention.registry import create_backend

    if not selection.is_hybrid:
        return create_backend(selection.prefill_backend, pool, hw, **options)
    prefill = create_backend(selection.prefill_backend, pool, hw, **options)
    decode = create_backend(selection.decode_backend, pool, hw, **options)
    return HybridAttentionBackend(prefill, decode, speculative_attention_mode)
