"""Greedy top-k routing in one launch: the router's logits, their scores and the top-k.

Unfused, routing a decode step's tokens is four or five launches (the float32 copy of x, the router GEMM, the
softmax, the top-k, the renormalisation) around expert GEMMs of tens of microseconds. Here one launch does it:
each token's logits are split over SPLIT programs along the hidden dimension (one program alone would read the
router's 64 x 2048 float32 weights, 512 KB for DeepSeek-V2-Lite, at one SM's bandwidth); each writes its
partial logits and takes a ticket from the token's counter, and the program with the last ticket sums the
partials in a fixed order (the same bits whichever program finishes first), scores every expert in float32,
picks the top-k by repeated arg-max (the highest score first, the lowest expert id among equal scores:
torch.topk names no order among ties) and resets the counter for the next launch.

Only the plain greedy methods run here (DeepSeek-V2-Lite's and Mixtral-style routers); group-limited and
bias-corrected choice (V2, V3) keep models/moe.py's torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import next_pow2
from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor

BLOCK_K = 128  # hidden columns per program (and per step of its loop)
MAX_SPLIT = 16  # programs per token along the hidden dimension


@triton.jit
def _route_kernel(
    X, W, Partial, Counter, Weights, Ids, stride_x, hidden, cols_per_program, scale,
    E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SOFTMAX: tl.constexpr, NORMALISE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    logits = tl.zeros((E_PAD,), dtype=tl.float32)
    lo = part * cols_per_program
    for k0 in range(lo, tl.minimum(lo + cols_per_program, hidden), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        x = tl.load(X + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(W + e[:, None] * hidden + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        logits += tl.sum(w * x[None, :], axis=1)  # [E_PAD]
    if SPLIT > 1:
        tl.store(Partial + (t * SPLIT + part) * E_PAD + e, logits)
        ticket = tl.atomic_add(Counter + t, 1, sem="acq_rel")  # the partial above is visible to the last
        if ticket == SPLIT - 1:
            logits = tl.zeros((E_PAD,), dtype=tl.float32)
            for s in range(SPLIT):  # in order: the sum does not depend on which program came last
                logits += tl.load(Partial + (t * SPLIT + s) * E_PAD + e, volatile=True)
            tl.atomic_xchg(Counter + t, 0)  # ready for the next launch (graph replays included)
            _pick_top_k(logits, e, e_ok, Weights, Ids, t, scale, TOP_K, K_PAD, SOFTMAX, NORMALISE)
    else:
        _pick_top_k(logits, e, e_ok, Weights, Ids, t, scale, TOP_K, K_PAD, SOFTMAX, NORMALISE)


@triton.jit
def _pick_top_k(logits, e, e_ok, Weights, Ids, t, scale, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                SOFTMAX: tl.constexpr, NORMALISE: tl.constexpr):
    """Scores of one token's logits `[E_PAD]`, its top-k written highest first."""
    if SOFTMAX:
        logits = tl.where(e_ok, logits, float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=0))
        scores = p / tl.sum(p, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    left = tl.where(e_ok, scores, -1.0)  # scores are >= 0: padding never wins
    slot = tl.arange(0, K_PAD)
    picked_w = tl.zeros((K_PAD,), dtype=tl.float32)
    picked_id = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, e, e.shape[0]), axis=0)  # the lowest id among equal scores
        picked_w = tl.where(slot == j, best, picked_w)
        picked_id = tl.where(slot == j, idx.to(tl.int64), picked_id)
        left = tl.where(e == idx, -2.0, left)
    if NORMALISE:
        picked_w = picked_w / (tl.sum(tl.where(slot < TOP_K, picked_w, 0.0), axis=0) + 1e-20)
    picked_w = picked_w * scale
    tl.store(Weights + t * TOP_K + slot, picked_w, mask=slot < TOP_K)
    tl.store(Ids + t * TOP_K + slot, picked_id, mask=slot < TOP_K)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tokens: int) -> torch.Tensor:
    """Per-token tickets, zero between launches (the last program of each token resets its own)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tokens:
        have = _COUNTERS[device] = torch.zeros(max(tokens, 128), dtype=torch.int32, device=device)  # [T]
    return have


def route_greedy(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, softmax: bool, normalise: bool,
                 scale: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, hidden]`, router_weight `[E, hidden]` float32 -> (weights `[T, top_k]` float32, ids `[T, top_k]`
    int64), highest score first: softmax (or sigmoid) scores of x W^T, the top_k kept, renormalised to sum 1
    when `normalise`, times `scale`."""
    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    if router_weight.shape != (experts, hidden) or router_weight.dtype != torch.float32 or not 0 < top_k <= experts:
        raise ValueError(f"route_greedy needs a float32 router weight [E, {hidden}] and 0 < top_k <= E; got "
                         f"{tuple(router_weight.shape)} {router_weight.dtype}, top_k {top_k}")
    if x.stride(-1) != 1 or not router_weight.is_contiguous():
        raise ValueError("route_greedy needs x contiguous in its last dimension and a contiguous router weight")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)  # [T, top_k]
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)  # [T, top_k]
    if not tokens:
        return weights, ids
    block_k = min(BLOCK_K, next_pow2(hidden))
    split = min(MAX_SPLIT, triton.cdiv(hidden, block_k))
    cols = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k
    split = triton.cdiv(hidden, cols)  # no program without columns
    e_pad = next_pow2(experts)
    partial = torch.empty(tokens, split, e_pad, dtype=torch.float32, device=x.device)  # [T, SPLIT, E_PAD]
    _route_kernel[(tokens, split)](
        x, router_weight, partial, _counters(x.device, tokens), weights, ids, x.stride(0), hidden, cols, float(scale),
        E=experts, E_PAD=e_pad, TOP_K=top_k, K_PAD=next_pow2(top_k), BLOCK_K=block_k, SPLIT=split,
        SOFTMAX=softmax, NORMALISE=normalise and top_k > 1, num_warps=4, **launch_options(pdl),
    )
    return weights, ids
