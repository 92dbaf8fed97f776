"""flashinfer: FlashInfer's kernels behind the attnserve contract, one backend class per pool kind.

- `FlashInferMHABackend` (mha.py): paged decode and paged / ragged prefill over an MHA/GQA pool.
- `FlashInferMLABackend` (mla.py): BatchMLAPagedAttentionWrapper over an MLA latent pool.
- csr.py: the host-side page tables both hand to FlashInfer's plan(), and the graph page-id buffer.
- common.py: the features both declare and the `flashinfer` accessor.
- workspace.py: the float workspace FlashInfer's plans carve their split-KV scratch from, sized before
  CUDA graphs fix its address.

The registry name `flashinfer` resolves to the class that fits the pool; `backend_class(pool)` and
`FlashInferBackend(pool, **options)` do the same for code that holds a pool. The `flashinfer` package is
imported only when a backend object is built.
"""

from __future__ import annotations

from attnserve.attention.backends.flashinfer.common import FEATURES, MLA_FEATURES, flashinfer_module
from attnserve.attention.backends.flashinfer.csr import HostCSR, graph_step_metadata, host_csr
from attnserve.attention.backends.flashinfer.mha import FlashInferMHABackend
from attnserve.attention.backends.flashinfer.mla import FlashInferMLABackend, choose_mla_kernel
from attnserve.attention.base import AttentionBackend


def backend_class(pool) -> type[AttentionBackend]:
    """The FlashInfer backend class that serves this pool: MLA for a latent pool, else MHA."""
    return FlashInferMLABackend if pool.is_mla else FlashInferMHABackend


def FlashInferBackend(pool, **options) -> AttentionBackend:  # noqa: N802 (builds one of two classes)
    """The FlashInfer backend for this pool, built with `options` (see each class for the ones it takes)."""
    return backend_class(pool)(pool, **options)


__all__ = ["FEATURES", "MLA_FEATURES", "FlashInferBackend", "FlashInferMHABackend", "FlashInferMLABackend", "HostCSR",
           "backend_class", "choose_mla_kernel", "flashinfer_module", "graph_step_metadata", "host_csr"]
