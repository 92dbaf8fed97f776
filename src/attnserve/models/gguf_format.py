"""A small GGUF parser: metadata as Python values, tensors as zero-copy views of a memory map.

The `gguf` package's reader builds an object per array element, which takes
seconds on a 50k-token vocabulary; this parser reads numeric arrays with one
numpy call and strings with one pass, so opening a file costs well under a
second. Format: ggml's docs/gguf.md (little-endian, versions 2 and 3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first); GGUF stores dims innermost first
    type_name: str  # ggml type, e.g. "Q4_1", "F32"
    data: np.ndarray  # raw bytes (uint8) of the tensor, a view of the file


class _Cursor:
    def __init__(self, buf: memoryview, source: str):
        self.buf, self.pos, self.source = buf, 0, source

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.source}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.source}: truncated GGUF string at byte {self.pos}")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += dt.itemsize * count
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.source}: unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALARS[vtype])


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """(metadata, tensors) of a GGUF file; ValueError naming the file if it is not a valid one."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    source = str(path)
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, file untouched
    buf = memoryview(mm)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError(f"{source}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    cur = _Cursor(buf, source)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{source}: unsupported GGUF version {version}; supported: 2, 3")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        ttype, offset = cur.scalar("<I"), cur.scalar("<Q")
        infos.append((name, dims, ttype, offset))
    align = int(meta.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, dims, ttype, offset in infos:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise ValueError(f"{source}: tensor {name} has unknown ggml type {ttype}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        numel = int(np.prod(dims)) if dims else 1
        nbytes = numel // block * block_bytes
        start = data_start + offset
        if start + nbytes > len(mm):
            raise ValueError(f"{source}: tensor {name} runs past the end of the file (truncated download?)")
        tensors.append(GGUFTensor(name, tuple(int(d) for d in reversed(dims)), qtype.name, mm[start : start + nbytes]))
    return meta, tensors
