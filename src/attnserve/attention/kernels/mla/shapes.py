"""The absorbed-MLA call's shapes, checked the same way by the decode and extend wrappers."""

from __future__ import annotations

import torch


def check_mla_shapes(q: torch.Tensor, kv_buffer: torch.Tensor, out: torch.Tensor, kv_lora_rank: int) -> int:
    """Validate an absorbed-MLA call (q `[T, H, rank + rope]`, latent `[slots, 1, rank + rope]`, out `[T, H, rank]`).

    Returns the rope width.
    """
    tokens, num_heads, width = q.shape
    rope = width - kv_lora_rank
    if kv_lora_rank & (kv_lora_rank - 1) or kv_lora_rank < 16:
        raise ValueError(f"kv_lora_rank must be a power of two >= 16 for the MLA kernel, got {kv_lora_rank}")
    if rope < 0 or kv_buffer.dim() != 3 or kv_buffer.shape[1:] != (1, width):
        raise ValueError(f"kv_buffer {tuple(kv_buffer.shape)} does not match q's width {width} "
                         f"(kv_lora_rank {kv_lora_rank} + rope {rope}, one latent head)")
    if out.shape != (tokens, num_heads, kv_lora_rank):
        raise ValueError(f"out {tuple(out.shape)} must be [{tokens}, {num_heads}, {kv_lora_rank}]")
    if q.stride(-1) != 1 or kv_buffer.stride(-1) != 1:
        raise ValueError("q and kv_buffer must be contiguous in their last dimension")
    return rope
