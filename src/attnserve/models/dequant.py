"""GGUF tensors -> dense torch tensors, decoded by the `gguf` package's numpy dequantisers."""

from __future__ import annotations

import numpy as np
import torch


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], dtype: torch.dtype, source: str) -> torch.Tensor:
    """Decode one tensor's data to `shape` (PyTorch order, outermost first) in `dtype`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        qtype = GGMLQuantizationType[type_name]
        dense = gguf_dequantize(raw, qtype)
    except (KeyError, NotImplementedError) as exc:
        raise ValueError(
            f"{source}: tensor type {type_name} is not supported; supported: the types the gguf package "
            "dequantizes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, K-quants, ...)"
        ) from exc
    dense = np.ascontiguousarray(dense, dtype=np.float32)
    if not dense.flags.writeable:  # F32 tensors come back as views of the read-only file map
        dense = dense.copy()
    return torch.from_numpy(dense).reshape(shape).to(dtype)
