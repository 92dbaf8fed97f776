"""Random paged batches with known contents: what tests and kernel races run on.

Pages are handed out in shuffled order so that a kernel that assumes contiguous
KV, or confuses pages with slots, gives wrong answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.layer import AttentionLayer
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.kvcache.pool import KVPool, MHAKVPool, MLAKVPool


@dataclass
class SyntheticBatch:
    fb: ForwardBatch
    layer: AttentionLayer
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D], this step's new keys (already stored in the pool)
    v: torch.Tensor | None  # [T, Hkv, Dv] (None for MLA)
    pool: KVPool


def make_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    v_head_dim: int | None = None,
    page_size: int = 1,
    dtype: torch.dtype = torch.float32,
    kv_dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    mode: ForwardMode | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    use_sinks: bool = False,
    custom_mask: bool = False,
    mla: tuple[int, int] | None = None,
    score_scale: float = 1.0,
    seed: int = 0,
    extra_pages: int = 3,
) -> SyntheticBatch:
    """Build a pool, fill every request's prefix with random K/V, store the new tokens' K/V.

    mla=(kv_lora_rank, rope_dim) makes an MLA batch: one latent KV head, head_dim = sum.
    score_scale multiplies q so softmax is peaked (x20 shows a missing rescale).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    device = torch.device(device)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    if mla is not None:
        num_kv_heads, head_dim, v_head_dim = 1, mla[0] + mla[1], mla[0]
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    pages_per_req = [(s + page_size - 1) // page_size for s in seq_lens]
    num_pages = sum(pages_per_req) + extra_pages + 1
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if mla is not None:
        pool = MLAKVPool(num_pages, page_size, 1, mla[0], mla[1], dtype=kv_dtype, device=device)
    else:
        pool = MHAKVPool(num_pages, page_size, 1, num_kv_heads, head_dim, v_head_dim, dtype=kv_dtype, device=device)
    if pool.is_fp8:
        pool.set_scales(0, 0.5, 0.25)
    max_ctx = max(seq_lens + [1])
    req_to_token = torch.zeros(bs + 2, max_ctx, dtype=torch.int32, device=device)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # never page 0
    rows = list(range(1, bs + 1))  # row 0 left unused on purpose
    used = 0
    for i, (row, npg, seq) in enumerate(zip(rows, pages_per_req, seq_lens)):
        pages = torch.tensor(perm[used : used + npg], dtype=torch.int64)
        used += npg
        slots = pool.slots_of_pages(pages.tolist())[:seq]
        req_to_token[row, :seq] = slots.to(torch.int32)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    lid = 0
    # fill every prefix through the pool's own store (quantising when FP8)
    pre_slots = [req_to_token[r, :p].long() for r, p in zip(rows, prefix_lens)]
    pre_slots = torch.cat(pre_slots) if pre_slots else torch.zeros(0, dtype=torch.long, device=device)
    kp = rand(pre_slots.numel(), num_kv_heads, head_dim)
    vp = None if mla else rand(pre_slots.numel(), num_kv_heads, v_head_dim)
    pool.store(lid, pre_slots, kp, vp)

    if mode is None:
        mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) and any(prefix_lens) else ForwardMode.EXTEND
    mask = None
    if custom_mask:
        parts = []
        for p, e in zip(prefix_lens, extend_lens):
            m = torch.rand(e, p + e, generator=g) < 0.6
            m[:, :p] = True
            m[torch.arange(e), p + torch.arange(e)] = True  # every token sees itself
            parts.append(m.reshape(-1))
        mask = torch.cat(parts).to(device)
    fb = ForwardBatch.from_lengths(mode, rows, prefix_lens, extend_lens, req_to_token, pool, custom_mask=mask)
    layer = AttentionLayer(
        lid,
        num_heads,
        num_kv_heads,
        head_dim,
        v_head_dim=v_head_dim,
        sliding_window=sliding_window,
        logit_cap=logit_cap,
        use_sinks=use_sinks,
        is_mla=mla is not None,
        scaling=(mla[0] // 4 + mla[1]) ** -0.5 if mla else None,
    ).to(device)
    if use_sinks:
        layer.sinks.data = (torch.randn(num_heads, generator=g) * 2).to(device)
    t = sum(extend_lens)
    q = rand(t, num_heads, head_dim, scale=score_scale)
    k = rand(t, num_kv_heads, head_dim)
    v = None if mla else rand(t, num_kv_heads, v_head_dim)
    pool.store(lid, fb.out_cache_loc, k, v)
    return SyntheticBatch(fb, layer, q, k, v, pool)
