"""GGUF files read through the `gguf` package: metadata as Python values, tensors as memory-mapped views.

`gguf.GGUFReader` does the parsing; this module only turns its fields into plain
Python values and its errors into ValueErrors that name the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first); GGUF stores dims innermost first
    type_name: str  # ggml type, e.g. "Q4_1", "F32"
    data: np.ndarray  # the tensor's data as the reader maps it (quantised types: uint8 blocks)


def _field_value(field):
    """A reader field as a Python value: scalars, strings, and lists of either."""
    from gguf import GGUFValueType

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return []
        # numeric arrays: the parts holding the values are contiguous views of one type
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    return field.contents()


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF file; ValueError naming the file if it is not a valid one."""
    from gguf import GGUFReader

    source = str(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{source}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, KeyError, struct errors...
        raise ValueError(f"{source}: not a valid GGUF file (truncated or corrupt): {exc}") from exc
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    tensors = [
        GGUFTensor(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name, t.data)
        for t in reader.tensors
    ]
    return meta, tensors
