"""attnserve's attention kernels over the paged KV pool, by family.

- mha/: MHA / GQA decode (Flash-Decoding), paged extend, the TMA prefill kernel, their tiles (mha/configs.py).
- mla/: absorbed MLA decode and extend in Triton, extend as decode rows, the decode table
  (mla/decode_table.json), and mla/gluon/: the Hopper Gluon decode kernels, their launch and shared parts.
- Shared by both: the online softmax and dots (common.py), the split-KV pieces (split_kv.py, split_plan.py,
  merge_tiled.py), extend tiles (extend_tiles.py), the KV store (store.py), the GPU target (gpu_target.py) and
  the interpreter shim (interpreter_compat.py).
- plan.py: the KernelPlan a backend keeps per layer signature; resolve.py: how one is chosen and described.

The kernel modules import triton at the top; import them only where triton is installed (the backends in
attention/backends/triton/ do so inside their methods). plan.py, resolve.py, gpu_target.py, split_plan.py,
mha/configs.py and mla/decode_table.py are plain Python.
"""
