"""What a kernel launch reads besides its tensors, in three small bundles the wrappers take.

`DecodeRows`: a decode step's rows over the paged pool and its split plan (one row per request, or per new
token in MLA's extend rows). `ExtendRows`: an extend step's query tiles and pages. `LayerParams`: the layer's
scales and masking features. Plain data, built by the backends once per step (rows) or per layer (params).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeRows:
    """kv_indptr `[B+1]` / kv_indices (pages) as in attention/metadata.py, seq_lens `[B]` int32, num_splits `[B]`
    int32 each in 1..max_splits; token_groups: (group_first `[G]`, group_ntok `[G]`, tokens) where a CTA takes
    several query tokens (MLA extend rows on the seesaw kernel), else None."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: torch.Tensor
    max_splits: int
    page_size: int
    token_groups: tuple | None = None


@dataclass(frozen=True)
class ExtendRows:
    """tiles: the host's query tile list (extend_tiles.ExtendTiles); qo_indptr `[B+1]`, kv_indptr / kv_indices
    as in attention/metadata.py, seq_lens `[B]` int32 (prefix + new); custom_mask: flattened per-request
    `[ext, seq]` uint8 masks with mask_indptr `[B]` int64 offsets, or None (causal); mask_new_keys_only: the
    masks are `[ext, ext]` over the new tokens and every row sees the whole cached prefix (speculative verify's
    tree mask, whose size does not depend on the prefix)."""

    tiles: object
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    mask_new_keys_only: bool = False


@dataclass(frozen=True)
class LayerParams:
    """A layer's softmax scale, the pool's per-tensor K/V scales (FP8), and its masking features."""

    sm_scale: float
    k_scale: float = 1.0
    v_scale: float = 1.0
    sliding_window: int | None = None
    logit_cap: float | None = None
    sinks: torch.Tensor | None = None


__all__ = ["DecodeRows", "ExtendRows", "LayerParams"]
