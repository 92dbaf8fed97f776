"""Which implementation of each non-attention op a model runs, chosen once when the engine builds it.

Fused Triton kernels run on CUDA devices with Triton installed; everything else (the CPU,
MPS, a GPU without Triton, or `--disable-fused-ops`) runs the unfused torch compositions of
ops/reference.py. A model holds one `OpSet` and never re-decides per call, so a step's
kernels are the same ones a CUDA graph captured.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from attnserve.ops import cpu, reference


@dataclass(frozen=True)
class OpSet:
    """The model's non-attention ops. `rope_store` is None when RoPE and the K/V store stay separate;
    `fused_moe` is None where routed experts run models/moe.py's torch paths (see ops/kernels/fused_moe.py);
    `mla_rope` is None where MLA's latent norm, RoPE and concatenations stay separate (ops/kernels/mla_rope.py);
    `mla_absorb_rope` is None where MLA's query absorption stays a batched GEMM before them (ops/kernels/mla_absorb.py);
    `moe_route` is None where the router's greedy top-k stays torch ops (ops/kernels/moe_route.py).

    split_gate_up: run the MLP's gate and up projections as two GEMMs over the halves of the
    merged weight (views, no copy) instead of one. On the CPU two fp32 GEMMs over the halves are
    faster than one over the merged weight at decode sizes, while in bf16 (as on GPUs) the merged
    GEMM is faster: so only fp32 CPU models split.
    """

    name: str
    rmsnorm: Callable
    add_rmsnorm: Callable
    silu_mul: Callable
    rope_store: Callable | None = None
    split_gate_up: bool = False
    fused_moe: Callable | None = None
    mla_rope: Callable | None = None
    mla_absorb_rope: Callable | None = None
    moe_route: Callable | None = None

    def describe(self) -> str:
        gemms = "; gate/up as two GEMMs" if self.split_gate_up else ""
        if self.name == "torch":
            return f"off (unfused torch ops{gemms})"
        if self.name == "cpu":
            return f"cpu (RMSNorm in one or two kernels; the rest unfused torch ops{gemms})"
        moe = ", MoE experts as two grouped GEMMs (SiLU x up and routing weights fused)" if self.fused_moe else ""
        moe += ", greedy routing in one kernel" if self.moe_route else ""
        mla = ", MLA's latent norm + RoPE + query assembly" if self.mla_rope else ""
        mla += " (+ the query absorption for a few tokens)" if self.mla_absorb_rope else ""
        return f"{self.name} (residual add + RMSNorm, SiLU x up, RoPE + K/V store{mla}{moe}{gemms})"


TORCH_OPS = OpSet("torch", reference.rmsnorm, reference.add_rmsnorm, reference.silu_mul)


def triton_ops(pdl: bool = False) -> OpSet:
    """The fused Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1 in tests); with `pdl`, each launched
    with programmatic dependent launch (ops/kernels/pdl.py).

    The one place ops meets triton, an optional package: its kernel modules import it."""
    from attnserve.ops.kernels.fused_moe import fused_experts
    from attnserve.ops.kernels.mla_absorb import mla_absorb_rope
    from attnserve.ops.kernels.mla_rope import mla_rope
    from attnserve.ops.kernels.moe_route import route_greedy
    from attnserve.ops.kernels.rmsnorm import add_rmsnorm, rmsnorm
    from attnserve.ops.kernels.rope_store import rope_store_kv
    from attnserve.ops.kernels.silu_mul import silu_mul

    ops = OpSet("triton", rmsnorm, add_rmsnorm, silu_mul, rope_store_kv, fused_moe=fused_experts, mla_rope=mla_rope,
                moe_route=route_greedy, mla_absorb_rope=mla_absorb_rope)
    if not pdl:
        return ops
    launched = {f.name: functools.partial(getattr(ops, f.name), pdl=True) for f in fields(OpSet)
                if callable(getattr(ops, f.name))}
    return replace(ops, name="triton+pdl", **launched)


def select_ops(device: str | torch.device, fused: bool = True, dtype: torch.dtype | None = None,
               pdl: bool = False) -> OpSet:
    """Fused Triton kernels on a CUDA device with Triton installed and `fused`; the torch ops otherwise.

    `dtype` (the model's) decides the gate/up GEMM split on the CPU (see OpSet). `pdl`: the Triton kernels
    with programmatic dependent launch, where the GPU has it (SM90 on).
    """
    device = torch.device(device)
    if fused and device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from attnserve.ops.kernels.pdl import pdl_applies

        return triton_ops(pdl=pdl and pdl_applies(device))
    if device.type == "cpu" and fused:
        return replace(TORCH_OPS, name="cpu", rmsnorm=cpu.rmsnorm, add_rmsnorm=cpu.add_rmsnorm,
                       split_gate_up=dtype == torch.float32)
    if device.type == "cpu" and dtype == torch.float32:
        return replace(TORCH_OPS, split_gate_up=True)
    return TORCH_OPS
