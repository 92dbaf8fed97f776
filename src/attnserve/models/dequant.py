"""GGUF block-quantised tensors -> dense torch tensors.

The common formats are decoded here in torch (vectorised, far faster than a
per-block loop): each block of 32 weights carries an fp16 scale (and for Q4_1 an
fp16 minimum) followed by the packed integers. Layouts as in ggml's
ggml-common.h: Q4 blocks keep weights 0-15 in the low nibbles and 16-31 in the
high ones. Other ggml types fall back to the `gguf` package's numpy decoder.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
TORCH_DECODED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes))  # [nblocks, bytes]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()  # [nblocks, 1]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)  # [nblocks, 32] uint8


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], dtype: torch.dtype, source: str) -> torch.Tensor:
    """Decode one tensor's raw data to `shape` (PyTorch order, outermost first) in `dtype`."""
    if type_name == "F32":
        out = torch.from_numpy(np.ascontiguousarray(raw).view(np.float32))
    elif type_name == "F16":
        out = torch.from_numpy(np.ascontiguousarray(raw).view(np.float16))
    elif type_name == "BF16":
        out = torch.from_numpy(np.ascontiguousarray(raw).view(np.int16)).view(torch.bfloat16)
    elif type_name == "Q8_0":
        b = _blocks(raw, 2 + BLOCK)
        out = _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    elif type_name == "Q4_0":
        b = _blocks(raw, 2 + BLOCK // 2)
        out = _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8.0)
    elif type_name == "Q4_1":
        b = _blocks(raw, 4 + BLOCK // 2)
        out = torch.addcmul(_f16(b, 2), _nibbles(b[:, 4:]).float(), _f16(b, 0))
    else:
        out = _numpy_fallback(raw, type_name, source)
    return out.reshape(shape).to(dtype)


def _numpy_fallback(raw: np.ndarray, type_name: str, source: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        qtype = GGMLQuantizationType[type_name]
        return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype), dtype=np.float32))
    except (KeyError, NotImplementedError) as exc:
        raise ValueError(
            f"{source}: tensor type {type_name} is not supported; supported: {', '.join(TORCH_DECODED)} "
            "and the other types the gguf package can dequantize"
        ) from exc
