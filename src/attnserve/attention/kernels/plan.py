"""KernelPlan: which kernel a layer signature runs, on which tile, with which split policy, and why.

A `LayerSignature` is what the choice depends on (family, heads, head dims, page size, dtypes, architecture);
a `KernelPlan` is the choice, made once per backend and signature by resolve.py and handed to every launch.
Plain data: the kernels read it, nothing here decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.kernels.gpu_target import GpuTarget
from attnserve.attention.kernels.split_plan import SplitPolicy

INTERPRETER = "interpreter"  # the arch of a signature that runs under TRITON_INTERPRET (CPU tests)


@dataclass(frozen=True)
class LayerSignature:
    """What a kernel choice depends on, for one backend's layers of one shape."""

    family: str  # "mha" or "mla"
    num_heads: int  # query heads (of one tensor-parallel rank)
    num_kv_heads: int  # MLA: 1, the latent
    head_dim: int  # q / k width; MLA: kv_lora_rank + rope
    v_head_dim: int  # MLA: kv_lora_rank
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    arch: str  # "sm90", "sm80", ...: the GPU's, or INTERPRETER
    kv_lora_rank: int = 0
    target: GpuTarget | None = None  # the GPU's shared memory budget (None: the interpreter's, unbounded)

    @classmethod
    def of_gpu(cls, target: GpuTarget | None, **fields) -> LayerSignature:
        arch = INTERPRETER if target is None else f"sm{target.capability[0]}{target.capability[1]}"
        return cls(arch=arch, target=target, **fields)

    def where(self) -> str:
        """`sm90, 128 heads, page 64`: what a plan's description says of the shape."""
        heads = f"{self.num_heads} heads" + (f" / {self.num_kv_heads} KV" if self.family == "mha" else "")
        return f"{self.arch}, {heads}, page {self.page_size}"


@dataclass(frozen=True)
class KernelPlan:
    """The kernel a layer signature runs, resolved once per backend and signature.

    kernel: "triton" (a Triton kernel, also under the interpreter) or a Gluon kernel's name ("gluon_scorer",
    "gluon_seesaw", "gluon_narrow"); config: its tile (mha.configs.DecodeConfig, mla.decode_table.MLADecodeConfig);
    split_policy: the Flash-Decoding split plan's policy with the tile's waves; programs_per_split: what the split
    plan counts per (request, split) (KV heads, or MLA's head groups); partials: the split partials' format
    ("float32", or "float16" rows scaled by a power of two); reason: why this kernel, in words.
    """

    signature: LayerSignature
    kernel: str
    config: object
    split_policy: SplitPolicy
    programs_per_split: int
    partials: str
    reason: str

    @property
    def is_gluon(self) -> bool:
        return self.kernel.startswith("gluon_")

    def describe(self) -> str:
        """`gluon scorer (sm90, 128 heads, page 64)`, `interpreter`, `triton (sm80, ...)`."""
        if self.signature.arch == INTERPRETER:
            return INTERPRETER
        return f"{self.kernel.replace('_', ' ')} ({self.signature.where()})"


__all__ = ["INTERPRETER", "KernelPlan", "LayerSignature"]
