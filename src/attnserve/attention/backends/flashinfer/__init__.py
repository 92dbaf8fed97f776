"""flashinfer: FlashInfer's kernels behind the attnserve contract, one backend class per pool kind.

- `FlashInferMHABackend` (mha.py): paged decode and paged / ragged prefill over an MHA/GQA pool.
- `FlashInferMLABackend` (mla.py): BatchMLAPagedAttentionWrapper over an MLA latent pool.
- csr.py: the host-side page tables both hand to FlashInfer's plan(), and the graph page-id buffer.
- common.py: the features both declare and the `flashinfer` accessor.
- workspace.py: the float workspace FlashInfer's plans carve their split-KV scratch from, sized before
  CUDA graphs fix its address.

The registry name `flashinfer` resolves to the class that fits the pool (`choice.registry`:
`backend_for_pool("flashinfer", pool)`). The `flashinfer` package is imported only when a backend object is
built.
"""

from __future__ import annotations

from attnserve.attention.backends.flashinfer.common import FEATURES, MLA_FEATURES, flashinfer_module
from attnserve.attention.backends.flashinfer.csr import HostCSR, graph_step_metadata, host_csr
from attnserve.attention.backends.flashinfer.mha import FlashInferMHABackend
from attnserve.attention.backends.flashinfer.mla import FlashInferMLABackend, choose_mla_kernel

__all__ = ["FEATURES", "MLA_FEATURES", "FlashInferMHABackend", "FlashInferMLABackend", "HostCSR",
           "choose_mla_kernel", "flashinfer_module", "graph_step_metadata", "host_csr"]
