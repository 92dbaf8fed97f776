"""GGUF 4-bit blocks (Q4_0, Q4_1) read as integer codes with per-group scales and zeros, not as floats.

A block holds 32 consecutive weights of one row: fp16 scale d (Q4_1: and fp16 minimum m), then 16
bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31. Q4_0 decodes as
d * (q - 8), Q4_1 as d * q + m. Both are written here in the convention of torch's CPU int4 matmul,
w = (q - 8) * scale + zero, so a Q4 tensor can be repacked for it without ever being rounded again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # weights per block, and the int4 kernel's group size
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


@dataclass
class Q4Codes:
    """codes [N, K] uint8 in 0..15; scale and zero [N, K / 32] float32: w = (codes - 8) * scale + zero."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, for tests and for checking against the gguf package's decoder."""
        s = self.scale.repeat_interleave(GROUP, dim=1)
        z = self.zero.repeat_interleave(GROUP, dim=1)
        return (self.codes.float() - 8) * s + z

    def take_rows(self, index: torch.Tensor) -> Q4Codes:
        return Q4Codes(self.codes[index], self.scale[index], self.zero[index])


def is_q4(type_name: str) -> bool:
    return type_name in _BLOCK_BYTES


def read_q4(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Q4Codes:
    """Decode the blocks of a [N, K] tensor (`raw`: the reader's uint8 view, one row of blocks per row)."""
    n, k = shape
    if not is_q4(type_name) or k % GROUP:
        raise ValueError(f"not a 4-bit GGUF tensor of whole blocks: {type_name} {shape}")
    size = _BLOCK_BYTES[type_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, size)  # [N, K/32, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d  # d*q + m == (q-8)*d + (m + 8d)
        qs = blocks[..., 4:]
    else:
        zero = np.zeros_like(d)
        qs = blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # [N, K]: low nibbles first
    return Q4Codes(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))
