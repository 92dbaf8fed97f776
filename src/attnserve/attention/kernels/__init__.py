"""Triton kernels over the paged KV pool: KV store, split-KV decode + merge, paged-prefix extend.

These modules import triton at the top; import them only where triton is installed
(the backend in attention/backends/triton.py does so inside its methods).
"""
