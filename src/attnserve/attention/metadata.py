"""CSR metadata over the paged KV cache, shared by every paged backend.

For a batch of B requests:
  qo_indptr        [B+1]  new-token offsets (query rows of request i are qo_indptr[i]:qo_indptr[i+1])
  kv_indptr        [B+1]  page offsets into kv_indices
  kv_indices       [nnz]  page ids of every request, in order
  kv_last_page_len [B]    tokens used in each request's last page (1..page_size)
This is FlashInfer's layout; page size 1 makes page ids equal slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.kvcache.pool import check_page_size


@dataclass
class PagedKVMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [nnz_pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    page_size: int
    batch_size: int


@dataclass
class MetadataBuffers:
    """Fixed-address buffers for CUDA graphs; builders write their first rows in place."""

    qo_indptr: torch.Tensor  # [max_bs+1] int32
    kv_indptr: torch.Tensor  # [max_bs+1] int32
    kv_indices: torch.Tensor  # [max_pages] int32
    kv_last_page_len: torch.Tensor  # [max_bs] int32

    @classmethod
    def allocate(cls, max_bs: int, max_pages: int, device) -> MetadataBuffers:
        def z(n):
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(z(max_bs + 1), z(max_bs + 1), z(max_pages), z(max_bs))


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def build_paged_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    page_size: int,
    buffers: MetadataBuffers | None = None,
    seq_lens_cpu: list[int] | None = None,
) -> PagedKVMetadata:
    """Vectorised over the batch: no Python loop over requests or tokens.

    req_to_token rows hold slots; a page's id is the slot of its first token // page_size.
    With `buffers`, results are written into their first rows and views of them returned.
    `seq_lens_cpu` (a host copy of the lengths) avoids every device->host sync.
    """
    check_page_size(page_size)
    bs = req_pool_indices.numel()
    device = req_to_token.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    extend_lens = extend_lens.to(device=device, dtype=torch.int32)
    if seq_lens_cpu is None:
        seq_lens_cpu = seq_lens.tolist()
    max_seq_len = max(seq_lens_cpu, default=0)
    if max_seq_len > req_to_token.shape[1]:
        raise ValueError(f"seq_len {max_seq_len} exceeds req_to_token width {req_to_token.shape[1]}")
    num_pages = (seq_lens + page_size - 1) // page_size  # [B]
    qo_indptr = _indptr(extend_lens)
    kv_indptr = _indptr(num_pages)
    # page ids by index arithmetic: position j of kv_indices belongs to request owner[j]
    nnz = sum((s + page_size - 1) // page_size for s in seq_lens_cpu)
    j = torch.arange(nnz, device=device)  # [nnz]
    starts = kv_indptr.long()
    owner = torch.searchsorted(starts[1:], j, right=True)  # [nnz]
    rows = req_pool_indices.to(device).long()[owner]
    kv_indices = (req_to_token[rows, (j - starts[owner]) * page_size] // page_size).to(torch.int32)
    kv_last_page_len = (seq_lens - (num_pages - 1) * page_size).clamp(min=0).to(torch.int32)

    if buffers is not None:
        if bs + 1 > buffers.qo_indptr.numel() or nnz > buffers.kv_indices.numel():
            raise ValueError(
                f"batch {bs} / {nnz} pages exceed graph buffers "
                f"({buffers.qo_indptr.numel() - 1} / {buffers.kv_indices.numel()})"
            )
        buffers.qo_indptr[: bs + 1].copy_(qo_indptr)
        buffers.kv_indptr[: bs + 1].copy_(kv_indptr)
        buffers.kv_indices[:nnz].copy_(kv_indices)
        buffers.kv_last_page_len[:bs].copy_(kv_last_page_len)
        qo_indptr = buffers.qo_indptr[: bs + 1]
        kv_indptr = buffers.kv_indptr[: bs + 1]
        kv_indices = buffers.kv_indices[:nnz]
        kv_last_page_len = buffers.kv_last_page_len[:bs]
    return PagedKVMetadata(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, bs)


def metadata_for_batch(fb, buffers: MetadataBuffers | None = None) -> PagedKVMetadata:
    """`build_paged_metadata` for a ForwardBatch (uses its host lengths, so no sync)."""
    return build_paged_metadata(
        fb.req_to_token,
        fb.req_pool_indices,
        fb.seq_lens,
        fb.extend_lens,
        fb.pool.page_size,
        buffers=buffers,
        seq_lens_cpu=fb.seq_lens_cpu,
    )


def slots_from_pages(meta: PagedKVMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand page-level CSR to token slots: (kv_token_indptr [B+1], kv_slots [total_tokens]).

    For backends that walk tokens rather than pages.
    """
    ps = meta.page_size
    kv_pages_per_req = meta.kv_indptr[1:] - meta.kv_indptr[:-1]
    seq_lens = torch.where(kv_pages_per_req > 0, (kv_pages_per_req - 1) * ps + meta.kv_last_page_len, 0)
    slots = (meta.kv_indices.long()[:, None] * ps + torch.arange(ps, device=meta.kv_indices.device)).reshape(-1)
    # drop the unused tail of each request's last page
    page_owner = torch.repeat_interleave(
        torch.arange(meta.batch_size, device=slots.device), kv_pages_per_req.long(), output_size=meta.kv_indices.numel()
    )
    pos_in_req = torch.arange(slots.numel(), device=slots.device) - (meta.kv_indptr.long()[page_owner] * ps).repeat_interleave(ps)
    keep = pos_in_req < seq_lens.long()[page_owner].repeat_interleave(ps)
    return _indptr(seq_lens), slots[keep]
