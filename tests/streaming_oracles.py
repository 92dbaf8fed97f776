"""The streaming algorithms attnserve's kernels implement, written plainly in torch.

Online softmax, the blockwise FlashAttention forward and the merge of two partial results by their
log-sum-exp: the pieces of the split-KV decode and the tiled extend kernels, each small enough to
read. test_reference.py checks them against the dense oracle in attnserve.reference.attention.
"""

from __future__ import annotations

import math

import torch


def online_softmax(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """Softmax over the last dim, streaming `chunk` columns at a time (running max and sum)."""
    n = scores.shape[-1]
    m = torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype, device=scores.device)
    s = torch.zeros_like(m)
    for start in range(0, n, chunk):
        x = scores[..., start : start + chunk]
        m_new = torch.maximum(m, x.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        s = s * torch.exp(m - m_safe) + torch.exp(x - m_safe[..., None]).sum(-1)
        m = m_new
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return torch.exp(scores - m_safe[..., None]) / s[..., None]


def flash_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FlashAttention forward for one sequence, in the inputs' dtype.

    q `[M, H, D]`, k `[N, H, D]`, v `[N, H, Dv]`; with causal the queries are the last M
    of the N positions. Tiles need not divide M or N. Returns o `[M, H, Dv]` and the
    row log-sum-exp `[M, H]` (natural log, of the scaled scores; -inf for empty rows).
    """
    M, H, D = q.shape
    N = k.shape[0]
    scale = D**-0.5 if scale is None else scale
    o = torch.zeros(M, H, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((M, H), -math.inf, dtype=q.dtype, device=q.device)
    offset = N - M
    for m0 in range(0, M, block_m):
        qi = q[m0 : m0 + block_m].transpose(0, 1)  # [H, bm, D]
        bm = qi.shape[1]
        row_max = torch.full((H, bm), -math.inf, dtype=q.dtype, device=q.device)
        row_sum = torch.zeros(H, bm, dtype=q.dtype, device=q.device)
        acc = torch.zeros(H, bm, v.shape[-1], dtype=q.dtype, device=q.device)
        q_pos = torch.arange(m0, m0 + bm, device=q.device) + offset
        for n0 in range(0, N, block_n):
            if causal and n0 > q_pos[-1]:
                break  # the tile is entirely in the future of every row
            kj = k[n0 : n0 + block_n].transpose(0, 1)  # [H, bn, D]
            vj = v[n0 : n0 + block_n].transpose(0, 1)
            s = torch.matmul(qi, kj.transpose(1, 2)) * scale  # [H, bm, bn]
            if causal:
                k_pos = torch.arange(n0, n0 + kj.shape[1], device=q.device)
                s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], -math.inf)
            new_max = torch.maximum(row_max, s.amax(-1))
            safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = torch.exp(s - safe[..., None])
            alpha = torch.exp(row_max - safe)
            row_sum = row_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, vj)
            row_max = new_max
        out = acc / row_sum.clamp_min(torch.finfo(q.dtype).tiny)[..., None]
        o[m0 : m0 + bm] = out.transpose(0, 1)
        safe = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        lse[m0 : m0 + bm] = (safe + torch.log(row_sum)).transpose(0, 1)
    return o, lse


def merge_attention_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets from their outputs and LSEs.

    o `[..., Dv]`, lse `[...]` (natural log). An empty side has lse = -inf.
    """
    m = torch.maximum(lse1, lse2)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse1 - m_safe)
    w2 = torch.exp(lse2 - m_safe)
    total = w1 + w2
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return o, m_safe + torch.log(total)
