"""Dtype names (model and KV cache) and the one resolution of "auto".

`resolve_dtypes` is what every part asks: the engine (`generate`, `serve`, the Python API, through
engine/startup.py and models/loader.py), `attnserve select`, `attnserve tune` and `attnserve kv-calc`. So the
dtypes `select` traces are the ones the engine runs with, on the same machine description.

- model dtype "auto": on a CPU, bf16 where it multiplies bf16 in hardware (AMX or AVX512-BF16; elsewhere
  bf16 is emulated, slower than fp32), else fp32; on a GPU (or MPS), the checkpoint's stated dtype
  (config.json's torch_dtype / dtype; a GGUF file states bf16), bf16 where it states none.
- KV-cache dtype "auto": the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

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

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8_e4m3",
          torch.float8_e5m2: "fp8_e5m2"}


def canonical_kv_dtype(name: str | torch.dtype) -> str:
    """Canonical short name ('bf16', 'fp16', 'fp32', 'fp8_e4m3', 'fp8_e5m2')."""
    return _SHORT[parse_kv_dtype(name)]


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


def parse_model_dtype(name: str | torch.dtype) -> torch.dtype:
    """A model dtype by name (or as given); "auto" is resolve_dtypes' to answer."""
    if isinstance(name, torch.dtype):
        return name
    if name not in MODEL_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: auto, {', '.join(MODEL_DTYPES)}")
    return MODEL_DTYPES[name]


GGUF_STATED_DTYPE = "bfloat16"  # what a GGUF file counts as stating (its blocks dequantize to any dtype)


def stated_dtype(hf_config: dict | None) -> str | None:
    """The dtype a checkpoint's config.json states (torch_dtype, or transformers 5's dtype), if any."""
    cfg = hf_config or {}
    stated = cfg.get("torch_dtype") or cfg.get("dtype")
    return str(stated) if stated else None


@dataclass(frozen=True)
class Dtypes:
    """The model and KV-cache dtypes an engine runs with, and why."""

    model: torch.dtype
    kv_cache: str  # canonical KV name: bf16, fp16, fp32, fp8_e4m3, fp8_e5m2
    model_reason: str
    kv_reason: str

    @property
    def model_name(self) -> str:
        return _SHORT[self.model]

    def describe(self) -> str:
        return f"dtype {self.model_name} ({self.model_reason}), KV cache {self.kv_cache} ({self.kv_reason})"


def resolve_dtypes(device: str, cpu_bf16: bool, dtype: str | torch.dtype = "auto",
                   kv_cache_dtype: str | torch.dtype = "auto", stated: str | None = None) -> Dtypes:
    """The model and KV-cache dtypes for `dtype` / `kv_cache_dtype` (names, "auto", or a model's torch dtype).

    device: where the model runs ("cpu", "cuda", "rocm", "mps", ...: a torch device type or Hardware.device).
    cpu_bf16: the CPU multiplies bf16 in hardware (Hardware.cpu_bf16). stated: the checkpoint's own dtype
    (stated_dtype(config), "bfloat16" for a GGUF file), which "auto" takes off the CPU.
    """
    if isinstance(dtype, torch.dtype):
        model, model_reason = dtype, "the model's"
    elif dtype != "auto":
        model, model_reason = parse_model_dtype(dtype), "as asked"
    elif device == "cpu":
        model = torch.bfloat16 if cpu_bf16 else torch.float32
        model_reason = ("auto: this CPU multiplies bf16 in hardware (AMX/AVX512-BF16)" if cpu_bf16
                        else "auto: no hardware bf16 on this CPU")
    else:
        model = MODEL_DTYPES.get(str(stated), torch.bfloat16) if stated else torch.bfloat16
        model_reason = (f"auto: the checkpoint's {stated}" if stated and str(stated) in MODEL_DTYPES
                        else "auto: the checkpoint states none, bf16")
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype == "auto":
        kv, kv_reason = canonical_kv_dtype(model), "auto: the model dtype"
    else:
        kv, kv_reason = canonical_kv_dtype(kv_cache_dtype), "as asked"
    return Dtypes(model, kv, model_reason, kv_reason)
