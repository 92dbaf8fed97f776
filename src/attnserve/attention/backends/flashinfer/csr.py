"""Host-side page tables for FlashInfer's plan() calls, and the fixed page-id buffer of its CUDA graphs.

Shared by the MHA backend (mha.py) and the MLA backend (mla.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnserve.attention.metadata import PagedKVMetadata, build_paged_metadata
from attnserve.batch import ForwardMode


@dataclass(frozen=True)
class HostCSR:
    """The small CSR arrays on the host, as FlashInfer's plan() reads them there."""

    qo_indptr: torch.Tensor  # [B+1] int32, CPU
    kv_indptr: torch.Tensor  # [B+1] int32, CPU
    kv_last_page_len: torch.Tensor  # [B] int32, CPU


def host_csr(seq_lens: list[int], extend_lens: list[int], page_size: int) -> HostCSR:
    """The values metadata.build_paged_metadata computes on the device, from host lengths."""
    pages = [(s + page_size - 1) // page_size for s in seq_lens]
    qo, kv = [0], [0]
    for e, n in zip(extend_lens, pages):
        qo.append(qo[-1] + e)
        kv.append(kv[-1] + n)
    last = [max(s - (n - 1) * page_size, 0) for s, n in zip(seq_lens, pages)]

    def t(values):
        return torch.tensor(values, dtype=torch.int32)

    return HostCSR(t(qo), t(kv), t(last))


def size_graph_page_buffer(buffers, max_bs: int, fb, pool, captured: bool) -> None:
    """max_bs rows of at most ceil(width / page_size) pages each: every batch fits, however pages are shared.

    The buffer is sized at the first capture, from req_to_token's width; once graphs hold its address
    (`captured`) a wider table is refused rather than moved.
    """
    needed = max_bs * math.ceil(fb.req_to_token.shape[1] / pool.page_size)
    if buffers.kv_indices.numel() >= needed:
        return
    if captured:
        raise ValueError(f"req_to_token width {fb.req_to_token.shape[1]} needs {needed} page slots, more than "
                         f"the {buffers.kv_indices.numel()} sized at the first capture")
    buffers.kv_indices = torch.zeros(needed, dtype=torch.int32, device=pool.device)  # [max_bs * max_pages]


def graph_step_metadata(fb, buffers, max_bs: int, pool, has_signatures: bool, captured: bool,
                        verify: bool = False) -> PagedKVMetadata:
    """Check a capture / replay batch, then write its page ids into the fixed buffers (their views returned).

    Each wrapper's plan() then copies the host indptr / lengths into its views of the other buffers. `verify`:
    the caller captures speculative verify steps too (chains: q tokens a request, no mask).
    """
    if verify and fb.mode is ForwardMode.TARGET_VERIFY:
        if fb.custom_mask is not None:
            raise ValueError("the flashinfer backend captures chain verify steps only (a tree verifies eagerly)")
        if len(set(fb.extend_lens_cpu)) > 1:
            raise ValueError(f"a verify graph runs as many tokens for every request, got {fb.extend_lens_cpu}")
    elif not fb.mode.is_decode:
        raise ValueError(f"the flashinfer backend captures decode only{' (and chain verify steps)' if verify else ''}, "
                         f"got {fb.mode.value}")
    if buffers is None:
        raise ValueError("call init_graph_buffers(max_bs, max_tokens) before capturing")
    if not has_signatures:
        raise ValueError("run one eager step before capture so the layer signatures are known")
    if fb.batch_size > max_bs:
        raise ValueError(f"batch {fb.batch_size} exceeds the captured maximum {max_bs}")
    size_graph_page_buffer(buffers, max_bs, fb, pool, captured)
    return build_paged_metadata(fb.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.extend_lens, pool.page_size,
                                buffers=buffers, seq_lens_cpu=fb.seq_lens_cpu)
