"""The oracle: slow, obviously-correct paged attention that every backend and kernel is tested against.

(The streaming algorithms the kernels implement, online softmax, blockwise flash forward and the
LSE merge, are written out in tests/streaming_oracles.py, checked there against this one.)

Conventions shared with every backend:
- Keys of a request sit at positions 0..seq_len-1; its new (query) tokens are the last
  extend_len of them, so query i has position prefix_len + i.
- causal: key j is visible to a query at position p iff j <= p.
- sliding_window W: additionally j > p - W (the window counts the query itself).
- logit_cap c: scores become c * tanh(scores / c) after scaling.
- sinks s_h: exp(s_h) joins the softmax denominator of head h and contributes no value.
- custom_mask: per request a bool [extend_len, seq_len] (True = visible), flattened and
  concatenated; it replaces the causal rule (the window still applies).
"""

from __future__ import annotations

import math

import torch


def visibility_mask(
    q_pos: torch.Tensor,
    seq_len: int,
    causal: bool = True,
    sliding_window: int | None = None,
    custom_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_q, seq_len] bool: which keys each query may see (True = visible)."""
    k_pos = torch.arange(seq_len, device=q_pos.device)
    if custom_mask is not None:
        mask = custom_mask.to(torch.bool).reshape(q_pos.numel(), seq_len)
    elif causal:
        mask = k_pos[None, :] <= q_pos[:, None]
    else:
        mask = torch.ones(q_pos.numel(), seq_len, dtype=torch.bool, device=q_pos.device)
    if sliding_window is not None:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense masked attention for one request in q's dtype.

    q `[M, Hq, D]`, k `[N, Hkv, D]`, v `[N, Hkv, Dv]`, mask `[M, N]` -> `[M, Hq, Dv]`.
    Rows with nothing visible (and no sink) give zeros.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q, k) * scale  # [Hq, M, N]
    if logit_cap is not None:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~mask[None], -math.inf)
    m = s.amax(-1, keepdim=True)  # [Hq, M, 1]
    if sinks is not None:
        m = torch.maximum(m, sinks.to(s.dtype)[:, None, None])
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.to(s.dtype)[:, None, None] - m)
    out = torch.einsum("hmn,nhd->mhd", p, v)
    return out / denom.clamp_min(torch.finfo(s.dtype).tiny).transpose(0, 1)


def paged_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices,
    seq_lens,
    extend_lens,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    logit_cap: float | None = None,
    custom_mask: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Naive paged attention, one request at a time, in `compute_dtype`.

    q `[T, Hq, D]` (new tokens of every request, concatenated); k_buffer `[slots, Hkv, D]`,
    v_buffer `[slots, Hkv, Dv]` in the pool's layout (FP8 buffers are dequantised with
    k_scale / v_scale). For MLA pass the latent buffer as k_buffer and its first
    kv_lora_rank columns as v_buffer. Returns `[T, Hq, Dv]` in compute_dtype.
    """
    rows = [int(x) for x in torch.as_tensor(req_pool_indices).tolist()]
    seqs = [int(x) for x in torch.as_tensor(seq_lens).tolist()]
    exts = [int(x) for x in torch.as_tensor(extend_lens).tolist()]
    out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[-1], dtype=compute_dtype, device=q.device)
    t0 = 0
    mask_off = 0
    for row, seq, ext in zip(rows, seqs, exts):
        slots = req_to_token[row, :seq].long()
        k = k_buffer[slots].to(compute_dtype) * k_scale
        v = v_buffer[slots].to(compute_dtype) * v_scale
        qi = q[t0 : t0 + ext].to(compute_dtype)
        q_pos = torch.arange(seq - ext, seq, device=q.device)
        cm = None
        if custom_mask is not None:
            cm = custom_mask[mask_off : mask_off + ext * seq]
            mask_off += ext * seq
        mask = visibility_mask(q_pos, seq, causal, sliding_window, cm)
        out[t0 : t0 + ext] = attend(qi, k, v, mask, scale, logit_cap, sinks)
        t0 += ext
    return out


def reference_for_batch(q: torch.Tensor, layer, fb, compute_dtype=torch.float64) -> torch.Tensor:
    """The oracle for an AttentionLayer and ForwardBatch, reading the pool as it stands."""
    pool = fb.pool
    lid = layer.layer_id
    return paged_attention_reference(
        q,
        pool.get_key_buffer(lid),
        pool.get_value_buffer(lid),
        fb.req_to_token,
        fb.req_pool_indices,
        fb.seq_lens_cpu,
        fb.extend_lens_cpu,
        scale=layer.scaling,
        causal=True,
        sliding_window=layer.sliding_window,
        sinks=layer.sinks,
        logit_cap=layer.logit_cap,
        custom_mask=fb.custom_mask,
        k_scale=pool.k_scale[lid],
        v_scale=pool.v_scale[lid],
        compute_dtype=compute_dtype,
    )
