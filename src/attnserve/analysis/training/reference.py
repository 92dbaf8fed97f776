"""Torch paths of the differentiable attention: the blockwise CPU path and the dense oracle.

`blockwise_forward` / `blockwise_backward` run the same algorithm as the Triton kernels with torch
operations, one block of query rows at a time: the forward keeps the row LSE, and the backward recomputes
P = exp(S - LSE) for one row block at a time, so nothing of size Tq x Tk exists at once (a row block's
scores are block x Tk). `dense_attention` is the plain formula (softmax(QK^T * scale) V over the full score
matrix) that tests differentiate with autograd as the oracle.

Shapes and visibility are those of analysis.training.kernels: q [B, Hq, Tq, D], k and v [B, Hkv, Tk, D],
query row i at key position i + Tk - Tq.
"""

from __future__ import annotations

import torch

REFERENCE_BLOCK = 64  # query rows per block of the blockwise path


def visibility(q_rows: torch.Tensor, Tq: int, Tk: int, causal: bool, window: int | None,
               device: torch.device) -> torch.Tensor | None:
    """[rows, Tk] bool mask of the visible keys of the given query rows; None when every key is visible."""
    if not causal and window is None:
        return None
    pos = q_rows[:, None] + (Tk - Tq)
    keys = torch.arange(Tk, device=device)[None, :]
    ok = torch.ones(len(q_rows), Tk, dtype=torch.bool, device=device)
    if causal:
        ok &= keys <= pos
    if window is not None:
        ok &= keys > pos - window
    return ok


def _scores(qb: torch.Tensor, k: torch.Tensor, sm_scale: float, softcap: float | None):
    """qb [B, Hkv, G, M, D], k [B, Hkv, Tk, D] -> scores [B, Hkv, G, M, Tk] (fp32 or fp64) and tanh(x / cap)."""
    x = torch.matmul(qb, k.unsqueeze(2).transpose(-1, -2)) * sm_scale
    if softcap is None:
        return x, None
    t = torch.tanh(x / softcap)
    return t * softcap, t


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _grouped(t: torch.Tensor, hk: int) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, G, T, D] (query head h = hk * G + g)."""
    B, H, T, D = t.shape
    return t.view(B, hk, H // hk, T, D)


def blockwise_forward(q, k, v, causal: bool, sm_scale: float, window: int | None, softcap: float | None,
                      block: int = REFERENCE_BLOCK):
    """O [B, Hq, Tq, D] in q's dtype and the natural-log row LSE [B, Hq, Tq] (float32, or float64)."""
    B, H, Tq, D = q.shape
    HK, Tk = k.shape[1], k.shape[2]
    acc = _acc(q)
    kf, vf = k.to(acc), v.to(acc)
    qg = _grouped(q, HK)
    o = torch.empty_like(q)
    og = _grouped(o, HK)
    lse = torch.empty((B, H, Tq), dtype=acc, device=q.device)
    lseg = lse.view(B, HK, H // HK, Tq)
    for m0 in range(0, Tq, block):
        rows = torch.arange(m0, min(m0 + block, Tq), device=q.device)
        s, _ = _scores(qg[:, :, :, m0:m0 + len(rows)].to(acc), kf, sm_scale, softcap)
        mask = visibility(rows, Tq, Tk, causal, window, q.device)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - row_lse.unsqueeze(-1))
        og[:, :, :, m0:m0 + len(rows)] = torch.matmul(p, vf.unsqueeze(2)).to(q.dtype)
        lseg[..., m0:m0 + len(rows)] = row_lse
    return o, lse


def blockwise_backward(do, q, k, v, o, lse, causal: bool, sm_scale: float, window: int | None,
                       softcap: float | None, block: int = REFERENCE_BLOCK):
    """dQ, dK, dV from P recomputed one row block at a time out of Q, K and the LSE."""
    B, H, Tq, D = q.shape
    HK, Tk = k.shape[1], k.shape[2]
    acc = _acc(q)
    kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
    qg, dog, og = _grouped(q, HK), _grouped(do, HK), _grouped(o, HK)
    lseg = lse.view(B, HK, H // HK, Tq)
    dq = torch.empty_like(q)
    dqg = _grouped(dq, HK)
    dk = torch.zeros((B, HK, Tk, D), dtype=acc, device=q.device)
    dv = torch.zeros((B, HK, Tk, D), dtype=acc, device=q.device)
    for m0 in range(0, Tq, block):
        sl = slice(m0, min(m0 + block, Tq))
        rows = torch.arange(sl.start, sl.stop, device=q.device)
        qb, dob = qg[:, :, :, sl].to(acc), dog[:, :, :, sl].to(acc)
        delta = (dob * og[:, :, :, sl].to(acc)).sum(-1, keepdim=True)
        s, t = _scores(qb, k.to(acc), sm_scale, softcap)
        p = torch.exp(s - lseg[..., sl].unsqueeze(-1))
        mask = visibility(rows, Tq, Tk, causal, window, q.device)
        if mask is not None:
            p = p.masked_fill(~mask, 0.0)
        dv += torch.matmul(p.transpose(-1, -2), dob).sum(2)
        dp = torch.matmul(dob, vf.transpose(-1, -2))
        ds = p * (dp - delta)
        if t is not None:
            ds = ds * (1 - t * t)
        dqg[:, :, :, sl] = (torch.matmul(ds, kf) * sm_scale).to(q.dtype)
        dk += torch.matmul(ds.transpose(-1, -2), qb).sum(2) * sm_scale
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def dense_attention(q, k, v, causal: bool = False, sm_scale: float | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """The plain formula over the full score matrix (the oracle; autograd differentiates it)."""
    B, H, Tq, D = q.shape
    HK, Tk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if sm_scale is None else sm_scale
    kr = k.repeat_interleave(H // HK, dim=1)
    vr = v.repeat_interleave(H // HK, dim=1)
    s = torch.matmul(q, kr.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = visibility(torch.arange(Tq, device=q.device), Tq, Tk, causal, window, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vr)
