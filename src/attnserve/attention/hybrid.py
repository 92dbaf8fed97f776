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

from attnserve.attention.base import AttentionBackend, BackendFeatures, StepMetadata
from attnserve.batch import ForwardBatch, ForwardMode

SPECULATIVE_ATTENTION_MODES = ("prefill", "decode")


# ---- what the pair can do -------------------------------------------------------------------------
# Every layer runs on both sides (prefill steps on one, decode steps on the other), so a feature the model
# needs must hold on both: flags are and-ed, sets and allowed lists intersected (None means any), the
# strictest minimum wins and the packages of both are needed. Five features belong to the steps of
# one side only (the engine captures CUDA graphs for decode steps; custom masks serve speculative
# verify; expanded MLA prefill runs fresh prompts); `hybrid_features` takes those from that side.
def _both(a: bool, b: bool) -> bool:
    return a and b


def _intersect(a, b):
    """Allowed values on both sides; None allows anything."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, frozenset):
        return a & b
    return tuple(x for x in a if x in b)


def _strictest_minimum(a, b):
    return b if a is None else a if b is None else max(a, b)


def _all_packages(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys((*a, *b)))


COMBINE_BOTH_SIDES = {
    "page_sizes": _intersect, "kv_dtypes": _intersect, "attention_types": _intersect, "head_dims": _intersect,
    "devices": _intersect, "compute_capabilities": _intersect,
    "asymmetric_kv": _both, "sliding_window": _both, "attention_sinks": _both, "logit_softcap": _both,
    "spec_topk1": _both, "spec_topk_gt1": _both, "spec_topk_gt1_paged": _both, "deterministic": _both,
    "implemented": _both,
    "min_compute_capability": _strictest_minimum,
    "required_packages": _all_packages,
}
ONE_SIDE = {"prefill": "prefill", "decode": "decode", "cuda_graph": "decode", "custom_mask": "verify",
            "expanded_mla_prefill": "prefill"}


def hybrid_features(prefill: BackendFeatures, decode: BackendFeatures, verify: BackendFeatures) -> BackendFeatures:
    """What a hybrid of these backends supports; `verify` is the features of the side that runs verify steps."""
    sides = {"prefill": prefill, "decode": decode, "verify": verify}
    values = {}
    for f in dataclasses.fields(BackendFeatures):
        if f.name in ONE_SIDE:
            values[f.name] = getattr(sides[ONE_SIDE[f.name]], f.name)
        elif f.name in COMBINE_BOTH_SIDES:
            values[f.name] = COMBINE_BOTH_SIDES[f.name](getattr(prefill, f.name), getattr(decode, f.name))
        else:
            raise TypeError(f"BackendFeatures.{f.name} has no rule for combining a hybrid's two sides")
    return BackendFeatures(**values)


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
        verify = prefill if speculative_attention_mode == "prefill" else decode
        self.features = hybrid_features(prefill.features, decode.features, verify.features)

    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
            return self.decode_backend
        if mode is ForwardMode.TARGET_VERIFY and self.speculative_attention_mode == "decode":
            return self.decode_backend
        return self.prefill_backend

    # ---- per step: planned on, and run by, the side that serves the step's mode (its metadata as it is) ----
    def plan(self, fb: ForwardBatch) -> StepMetadata:
        return self.backend_for(fb.mode).plan(fb)

    def store_kv(self, layer, fb: ForwardBatch, k, v) -> None:
        self.backend_for(fb.mode).store_kv(layer, fb, k, v)

    def rotate_and_store_kv(self, layer, fb: ForwardBatch, q, k, v, rope):
        return self.backend_for(fb.mode).rotate_and_store_kv(layer, fb, q, k, v, rope)

    def forward(self, q, k, v, layer, fb: ForwardBatch, meta: StepMetadata):
        return self.backend_for(fb.mode).forward(q, k, v, layer, fb, meta)

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch, meta: StepMetadata):
        return self.backend_for(fb.mode).forward_extend(q, k, v, layer, fb, meta)

    def forward_decode(self, q, layer, fb: ForwardBatch, meta: StepMetadata):
        return self.backend_for(fb.mode).forward_decode(q, layer, fb, meta)

    # ---- expanded MLA prefill: asked of, and run by, the side that serves the step (prefill for fresh prompts) ----
    def expanded_prefill_applies(self, fb: ForwardBatch, meta: StepMetadata) -> bool:
        side = self.backend_for(fb.mode)
        return side.features.expanded_mla_prefill and side.expanded_prefill_applies(fb, meta)

    def forward_expanded_prefill(self, q, k, v, layer, fb: ForwardBatch, meta: StepMetadata):
        return self.backend_for(fb.mode).forward_expanded_prefill(q, k, v, layer, fb, meta)

    # ---- CUDA graphs: decode graphs belong to the decode backend; verify graphs to whichever serves verify ----
    def init_graph_buffers(self, max_bs: int, max_tokens: int) -> None:
        self.graph_max_bs = max_bs
        self.decode_backend.init_graph_buffers(max_bs, max_tokens)
        verify = self.backend_for(ForwardMode.TARGET_VERIFY)
        if verify is not self.decode_backend and verify.features.cuda_graph:
            verify.init_graph_buffers(max_bs, max_tokens)

    def plan_for_capture(self, fb: ForwardBatch) -> StepMetadata:
        return self.backend_for(fb.mode).plan_for_capture(fb)

    def plan_for_replay(self, fb: ForwardBatch) -> StepMetadata:
        return self.backend_for(fb.mode).plan_for_replay(fb)
