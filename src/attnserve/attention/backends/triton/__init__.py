"""triton: attnserve's own Triton kernels behind the backend contract, one class per attention family.

`TritonMHABackend` (mha.py) serves MHA / GQA pools, `TritonMLABackend` (mla.py) MLA latent pools; common.py
holds what they share. The registry's `triton` name resolves to the class that fits the pool
(`choice.registry`: `backend_for_pool("triton", pool)`).
"""

from __future__ import annotations

from attnserve.attention.backends.triton.mha import TritonMHABackend
from attnserve.attention.backends.triton.mla import TritonMLABackend

__all__ = ["TritonMHABackend", "TritonMLABackend"]
