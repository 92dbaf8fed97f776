"""What the MHA and MLA FlashInfer backends share: the features they declare and the package accessor.

`flashinfer` is an optional package: `flashinfer_module()` is the one place it is imported, when a
backend object is built, so that reading a backend's features never needs it.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from attnserve._lazy import require
from attnserve.attention.base import EVERY_VERIFY_SHAPE, BackendFeatures

FEATURES = BackendFeatures(
    kv_dtypes=frozenset({"bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}),
    attention_types=frozenset({"MHA", "GQA"}),
    head_dims=(64, 128, 256),
    sliding_window=True,
    logit_softcap=True,
    **EVERY_VERIFY_SHAPE,
    cuda_graph=True,
    devices=frozenset({"cuda"}),
    min_compute_capability=(8, 0),
    required_packages=("flashinfer",),
)
"""The MHA/GQA backend's features."""

MLA_FEATURES = dataclasses.replace(
    FEATURES,
    attention_types=frozenset({"MLA"}),
    kv_dtypes=frozenset({"bf16", "fp16", "fp8_e4m3"}),  # the MLA wrapper reads e4m3 latents only
    custom_mask=False,  # the MLA wrapper has no custom masks, so no tree verify either
    spec_topk_gt1=False,
    spec_topk_gt1_paged=False,
)
"""The MLA backend's features (BatchMLAPagedAttentionWrapper over the latent pool)."""


def flashinfer_module(purpose: str = "the flashinfer attention backend") -> ModuleType:
    """The `flashinfer` package, or MissingDependencyError naming the install command."""
    return require("flashinfer", purpose)


def default_q_dtype(pool) -> torch.dtype:
    """Queries and outputs in the pool's dtype, or bf16 over an FP8 pool."""
    return torch.bfloat16 if pool.is_fp8 else pool.dtype
