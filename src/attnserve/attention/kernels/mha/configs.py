"""The MHA decode tiles per architecture, and which calls the TMA prefill kernel takes: plain Python.

Read by the kernels' wrappers and by the kernel plan (attention/kernels/plan.py), which resolves and describes
a backend's kernels on machines without triton or a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.kernels.gpu_target import GpuTarget


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


# arch -> (block_n at page size 1, block_n for larger pages, num_warps, num_stages). sm90: page size 1 prefers
# 128-token tiles and larger pages 64-token ones for bf16 GQA decode. The others keep the same shape scaled to
# their shared memory (163 KiB on sm80, 99 KiB on sm86/sm89 and unknown GPUs).
DECODE_TILES = {
    "sm90": (128, 64, 4, 3),
    "sm80": (64, 64, 4, 3),
    "sm86": (64, 32, 4, 2),
    "sm89": (64, 32, 4, 2),
    "default": (64, 32, 4, 2),
}


def default_decode_config(head_dim: int, page_size: int, target: GpuTarget | None = None) -> DecodeConfig:
    """The architecture's tiles (Hopper's when the target is unknown, e.g. under the interpreter).

    Wider heads halve the key tile to stay in registers and shared memory.
    """
    block_p1, block_paged, warps, stages = DECODE_TILES[target.arch if target else "sm90"]
    block_n = block_p1 if page_size == 1 else block_paged
    if head_dim > 128:
        block_n //= 2
    return DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)


def fast_path_blocker(*, head_dim: int, v_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                      custom_mask, target: GpuTarget | None, interpreting: bool) -> str | None:
    """Why a call cannot take this kernel (None: it can). Cheap host checks, made per call."""
    if custom_mask is not None:
        return "custom mask"
    if kv_dtype != q_dtype:
        return f"KV dtype {kv_dtype} differs from q's {q_dtype} (FP8 pool)"
    if q_dtype not in (torch.bfloat16, torch.float16) and not interpreting:
        return f"{q_dtype} inputs"
    if head_dim != v_dim:
        return "V head dim differs from K's"
    if head_dim not in (64, 128, 256):
        return f"head_dim {head_dim} (TMA tiles need 64, 128 or 256)"
    if not interpreting and (target is None or target.arch != "sm90"):
        return "not Hopper (sm90)"
    return None
