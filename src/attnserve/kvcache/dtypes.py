"""KV-cache dtype names (SGLang's `--kv-cache-dtype` spellings) -> torch dtypes."""

from __future__ import annotations

import torch

KV_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def canonical_kv_dtype(name: str | torch.dtype) -> str:
    """Canonical short name ('bf16', 'fp16', 'fp32', 'fp8_e4m3', 'fp8_e5m2')."""
    dtype = parse_kv_dtype(name)
    return {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.float8_e4m3fn: "fp8_e4m3",
        torch.float8_e5m2: "fp8_e5m2",
    }[dtype]


def parse_kv_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in KV_DTYPES.values():
            raise ValueError(f"unsupported KV dtype {name}; allowed: {sorted(set(KV_DTYPES))}")
        return name
    if not isinstance(name, str):
        raise ValueError(f"KV cache dtype must be a name or torch dtype, got {name!r}; allowed: {sorted(KV_DTYPES)}")  # noqa: TRY004
    try:
        return KV_DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; allowed: {sorted(KV_DTYPES)}") from None


def dtype_bytes(name: str | torch.dtype) -> int:
    return parse_kv_dtype(name).itemsize
