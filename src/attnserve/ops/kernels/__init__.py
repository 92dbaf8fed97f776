"""Triton kernels of the fused ops. These modules import triton at the top; ops/select.py imports
them only when it picks the Triton set."""
