"""Fused non-attention kernels (residual add + RMSNorm, SiLU x up, RoPE + K/V store, routed experts).

Each op has a Triton kernel (ops/kernels/, imported only where Triton is) and the unfused
torch composition it replaces (ops/reference.py; the routed experts' in models/moe.py), which
the CPU runs and the tests compare against. `select_ops` picks one set per model at engine start-up.
"""

from attnserve.ops.select import TORCH_OPS, OpSet, select_ops, triton_ops

__all__ = ["TORCH_OPS", "OpSet", "select_ops", "triton_ops"]
