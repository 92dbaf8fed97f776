"""CSR metadata against a plain loop over requests, on random ragged batches with shuffled pages."""

import random

import pytest
import torch

from attnserve.attention.metadata import (
    MetadataBuffers,
    build_paged_metadata,
    metadata_for_batch,
    slots_from_pages,
)
from attnserve.batch import ForwardMode
from attnserve.reference.synthetic import make_batch


def _random_table(rng: random.Random, page_size: int, bs: int):
    """req_to_token whose rows walk shuffled pages; returns the table, rows used, seq and extend lengths."""
    seq_lens = [rng.randint(1, 40) for _ in range(bs)]
    extend_lens = [rng.randint(1, s) for s in seq_lens]
    pages_needed = sum((s + page_size - 1) // page_size for s in seq_lens)
    pages = list(range(1, pages_needed + 5))
    rng.shuffle(pages)
    width = max(seq_lens) + rng.randint(0, 7)
    table = torch.zeros(bs + 3, width, dtype=torch.int32)  # [max_reqs, max_context]
    rows = rng.sample(range(bs + 3), bs)
    for row, seq in zip(rows, seq_lens):
        for t in range(seq):
            if t % page_size == 0:
                page = pages.pop()
            table[row, t] = page * page_size + t % page_size
    return table, rows, seq_lens, extend_lens


def _loop_csr(table, rows, seq_lens, extend_lens, page_size):
    qo, kv, indices, last = [0], [0], [], []
    for row, seq, ext in zip(rows, seq_lens, extend_lens):
        qo.append(qo[-1] + ext)
        req_pages = [int(table[row, t]) // page_size for t in range(0, seq, page_size)]
        indices += req_pages
        kv.append(kv[-1] + len(req_pages))
        last.append(seq - (len(req_pages) - 1) * page_size)
    return qo, kv, indices, last


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_metadata_matches_a_loop_built_csr(page_size, seed):
    rng = random.Random(seed * 31 + page_size)
    bs = rng.randint(1, 7)
    table, rows, seq_lens, extend_lens = _random_table(rng, page_size, bs)
    meta = build_paged_metadata(table, torch.tensor(rows), torch.tensor(seq_lens), torch.tensor(extend_lens),
                                page_size)
    qo, kv, indices, last = _loop_csr(table, rows, seq_lens, extend_lens, page_size)
    assert meta.qo_indptr.tolist() == qo
    assert meta.kv_indptr.tolist() == kv
    assert meta.kv_indices.tolist() == indices
    assert meta.kv_last_page_len.tolist() == last
    assert all(d == torch.int32 for d in (meta.qo_indptr.dtype, meta.kv_indptr.dtype, meta.kv_indices.dtype))
    assert meta.batch_size == bs and meta.page_size == page_size

    # expanding pages back to slots recovers every request's row of req_to_token
    token_indptr, slots = slots_from_pages(meta)
    assert token_indptr.tolist() == [0] + torch.tensor(seq_lens).cumsum(0).tolist()
    expected = torch.cat([table[r, :s].long() for r, s in zip(rows, seq_lens)])
    assert torch.equal(slots.long(), expected)


@pytest.mark.parametrize("page_size", [1, 4])
def test_fixed_buffers_are_written_in_place(page_size):
    rng = random.Random(page_size)
    buffers = MetadataBuffers.allocate(max_bs=8, max_pages=200, device="cpu")
    buffers.kv_indices.fill_(-7)  # stale contents past the live rows must not matter
    addresses = [t.data_ptr() for t in (buffers.qo_indptr, buffers.kv_indptr, buffers.kv_indices,
                                         buffers.kv_last_page_len)]
    for _ in range(3):  # several steps reuse the same buffers
        bs = rng.randint(1, 8)
        table, rows, seq_lens, extend_lens = _random_table(rng, page_size, bs)
        meta = build_paged_metadata(table, torch.tensor(rows), torch.tensor(seq_lens),
                                    torch.tensor(extend_lens), page_size, buffers=buffers)
        qo, kv, indices, last = _loop_csr(table, rows, seq_lens, extend_lens, page_size)
        assert meta.qo_indptr.tolist() == qo and meta.kv_indptr.tolist() == kv
        assert meta.kv_indices.tolist() == indices and meta.kv_last_page_len.tolist() == last
        assert meta.kv_indices.data_ptr() == buffers.kv_indices.data_ptr()  # views, not copies
        assert buffers.qo_indptr[: bs + 1].tolist() == qo
    assert addresses == [t.data_ptr() for t in (buffers.qo_indptr, buffers.kv_indptr, buffers.kv_indices,
                                                 buffers.kv_last_page_len)]


def test_batch_larger_than_buffers_is_refused():
    rng = random.Random(3)
    table, rows, seq_lens, extend_lens = _random_table(rng, 1, 4)
    buffers = MetadataBuffers.allocate(max_bs=2, max_pages=500, device="cpu")
    with pytest.raises(ValueError, match="graph buffers"):
        build_paged_metadata(table, torch.tensor(rows), torch.tensor(seq_lens), torch.tensor(extend_lens), 1,
                             buffers=buffers)


def test_bad_page_size_and_too_long_sequences():
    table = torch.zeros(2, 8, dtype=torch.int32)
    args = (table, torch.tensor([0]), torch.tensor([4]), torch.tensor([4]))
    with pytest.raises(ValueError, match="power of two"):
        build_paged_metadata(*args, 3)
    with pytest.raises(ValueError, match="exceeds req_to_token width"):
        build_paged_metadata(table, torch.tensor([0]), torch.tensor([9]), torch.tensor([1]), 1)


@pytest.mark.parametrize("page_size", [1, 16])
def test_metadata_for_a_synthetic_batch(page_size):
    sb = make_batch([0, 17, 5], [9, 1, 4], page_size=page_size, mode=ForwardMode.EXTEND)
    meta = metadata_for_batch(sb.fb)
    _, slots = slots_from_pages(meta)
    expected = torch.cat([sb.fb.req_to_token[r, :s].long() for r, s in zip([1, 2, 3], [9, 18, 9])])
    assert torch.equal(slots.long(), expected)
    assert meta.qo_indptr.tolist() == [0, 9, 10, 14]
