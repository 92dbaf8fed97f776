"""Differentiable attention for training: a FlashAttention forward that keeps the row LSE and a backward
that recomputes P from it (Triton kernels, with a blockwise torch path on the CPU)."""

from attnserve.analysis.training.function import (
    FlashAttentionFunction,
    flash_attention,
    flash_attention_with_lse,
)
from attnserve.analysis.training.reference import dense_attention

__all__ = ["FlashAttentionFunction", "dense_attention", "flash_attention", "flash_attention_with_lse"]
