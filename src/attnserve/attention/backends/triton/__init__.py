"""triton: attnserve's own Triton kernels behind the backend contract, one class per attention family.

`TritonMHABackend` (mha.py) serves MHA / GQA pools, `TritonMLABackend` (mla.py) MLA latent pools; common.py
holds what they share. The registry's `triton` name resolves to the class that fits the pool;
`TritonBackend(pool, **options)` does the same for code that holds a pool.
"""

from __future__ import annotations

from attnserve.attention.backends.triton.common import FEATURES, TritonBackendBase
from attnserve.attention.backends.triton.mha import TritonMHABackend
from attnserve.attention.backends.triton.mla import TritonMLABackend


class TritonBackend:
    """The registry's entry: `TritonBackend(pool, **options)` is a TritonMHABackend or a TritonMLABackend,
    whichever fits the pool; `TritonBackend.name` and `.features` are the family's shared ones."""

    name = TritonBackendBase.name
    features = FEATURES

    def __new__(cls, pool, **options):
        return (TritonMLABackend if pool.is_mla else TritonMHABackend)(pool, **options)


__all__ = ["TritonBackend", "TritonMHABackend", "TritonMLABackend"]
