"""The training forward through the serving prefill kernel (attention.kernels.mha.prefill_tma), LSE too.

A causal training forward is a prefill: every row of a sequence against that sequence's keys, query row i at
key position i + Tk - Tq. The serving kernel already does this with TMA loads and, on Hopper at head_dim 128,
one producer and two consumer warpgroups, where the blocked kernel of analysis.training.kernels takes pointer
loads and no specialisation; with HAS_LSE it also writes the row LSE the backward recomputes P from.

Two layouts reach it without a copy (the kernel reads `[rows, heads, dim]` tensors with contiguous rows):

    heads-major   q, k and v contiguous [B, H, T, D]: each (batch, query head) is a request of one head
                  over rows [B * H * T, 1, D]; its keys are the rows of (batch, query head // group)
    tokens-major  q.transpose(1, 2) (likewise k, v) contiguous [B, T, H, D], as a projection's output
                  viewed per head: each batch is a request of H heads over rows [B * T, H, D]

Anything else, non-causal attention, float32 / float64 and GPUs before Hopper take the blocked kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from attnserve.attention.kernels.common import interpreting
from attnserve.attention.kernels.extend_tiles import ExtendTiles
from attnserve.attention.kernels.mha.prefill_tma import (
    INTERPRETER_PREFILL_TMA_TILES,
    PREFILL_TMA_TILES,
    PrefillTmaConfig,
    prefill_tma_attention,
    tma_rows_ok,
)
from attnserve.attention.kernels.params import LayerParams

ORDERS = ("heads_fastest", "head_by_head")


@dataclass(frozen=True)
class TmaForward:
    """The prefill kernel's config and the order of its work list.

    heads_fastest: the heaviest query tiles of every (batch, head) first, the serving order (the first wave
    has the same tile of many heads in flight, and reads all their keys); head_by_head: each request's tiles
    in turn, heaviest first, so the programs in flight share one head's keys in L2.
    """

    config: PrefillTmaConfig
    order: str = "heads_fastest"

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")


# sm90, by head dim, from training_h200.py's sweep (benchmarks/results/training-h100.json: causal, 16 heads,
# 16k tokens, T = 1k / 4k / 16k). At 128 the warp-specialised kernel one program a tile, each head's tiles
# launched together, the heaviest first: its mean time against the best candidate at each T was 1.02, the
# blocked kernel's 1.07, the serving default's (persistent, heads fastest) 1.09: the persistent list keeps many
# heads' keys in flight and is the slower at 16k. At 64 (training-h100-d64.json) the blocked kernel beats the
# prefill kernel's unspecialised tiles (1.07), so 64 and every head dim not swept take the blocked kernel.
GPU_TMA_FORWARD: dict[int, TmaForward | None] = {
    128: TmaForward(dataclasses.replace(PREFILL_TMA_TILES[128], persistent=0), "head_by_head"),
}
INTERPRETER_TMA_FORWARD = TmaForward(INTERPRETER_PREFILL_TMA_TILES, "heads_fastest")


def default_tma_forward(head_dim: int, device: torch.device) -> TmaForward | None:
    if interpreting():
        return INTERPRETER_TMA_FORWARD
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    return GPU_TMA_FORWARD.get(head_dim)


def _heads_major(t: torch.Tensor) -> bool:
    return t.is_contiguous()


def _tokens_major(t: torch.Tensor) -> bool:
    return t.transpose(1, 2).is_contiguous()


def layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """"heads" or "tokens" when q, k and v share a layout the kernel reads in place, else None."""
    for name, test in (("heads", _heads_major), ("tokens", _tokens_major)):
        if all(test(t) for t in (q, k, v)):
            rows = [_rows(t, name) for t in (q, k, v)]
            if all(tma_rows_ok(r) for r in rows):
                return name
    return None


def applicable_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      choice: TmaForward | None) -> str | None:
    """The layout in which this forward can take the prefill kernel, or None (see the module docstring)."""
    if choice is None or not causal or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    return layout(q, k, v) if q.shape[-1] in PREFILL_TMA_TILES else None


def _rows(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A [B, H, T, D] tensor as the kernel's `[rows, heads, D]` view (no copy)."""
    b, h, n, d = t.shape
    if kind == "heads":
        return t.view(b * h * n, 1, d)
    return t.transpose(1, 2).view(b * n, h, d)


@functools.lru_cache(maxsize=64)
def _work(requests: int, kv_request_of: tuple[int, int], tq: int, tk: int, block_m: int, order: str,
          device: torch.device):
    """(tiles, qo_indptr [R+1], kv_starts [R], seq_lens [R]) of R equal requests, built once per shape.

    kv_request_of = (query heads per batch H, KV heads per batch HK) maps a heads-major request r = b * H + h
    to its keys' request b * HK + h // (H // HK); (1, 1) maps request r to r (tokens-major).
    """
    heads, kv_heads = kv_request_of
    r = torch.arange(requests, device=device)
    kv_request = r // heads * kv_heads + r % heads // (heads // kv_heads)
    kv_starts = (kv_request * tk).to(torch.int32)  # [R]
    qo_indptr = (torch.arange(requests + 1, device=device) * tq).to(torch.int32)  # [R+1]
    seq_lens = torch.full((requests,), tk, dtype=torch.int32, device=device)  # [R]
    m0 = torch.arange(0, tq, block_m, device=device).flip(0)  # [tiles per request], the heaviest first
    per = m0.numel()
    if order == "heads_fastest":
        tile_m0, tile_req = m0.repeat_interleave(requests), r.repeat(per)
    else:
        tile_m0, tile_req = m0.repeat(requests), r.repeat_interleave(per)
    tiles = ExtendTiles(tile_req.to(torch.int32), tile_m0.to(torch.int32), block_m)  # [R * per] each
    return tiles, qo_indptr, kv_starts, seq_lens


def forward_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, window: int | None,
                softcap: float | None, choice: TmaForward,
                kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal O [B, Hq, Tq, D] (in q's layout) and the natural-log row LSE [B, Hq, Tq] float32, contiguous.
    kind: layout(q, k, v) where the caller has it already."""
    kind = kind or layout(q, k, v)
    if kind is None:
        raise ValueError("q, k and v must all be heads-major or all tokens-major contiguous (see forward_tma)")
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    cfg = choice.config
    if kind == "heads":
        o = torch.empty_like(q)  # [B, H, Tq, D]
        lse = torch.empty((b * h * tq, 1), device=q.device, dtype=torch.float32)  # [B*H*Tq, 1]
        work = _work(b * h, (h, hk), tq, tk, cfg.block_m, choice.order, q.device)
    else:
        o = torch.empty((b, tq, h, d), device=q.device, dtype=q.dtype).transpose(1, 2)  # [B, H, Tq, D]
        lse = torch.empty((b * tq, h), device=q.device, dtype=torch.float32)  # [B*Tq, H]
        work = _work(b, (1, 1), tq, tk, cfg.block_m, choice.order, q.device)
    tiles, qo_indptr, kv_starts, seq_lens = work
    layer = LayerParams(sm_scale, sliding_window=window, logit_cap=softcap)
    prefill_tma_attention(_rows(q, kind), _rows(k, kind), _rows(v, kind), kv_starts, _rows(o, kind), tiles,
                          qo_indptr, seq_lens, layer, config=cfg, lse=lse)
    if kind == "heads":
        return o, lse.view(b, h, tq)
    return o, lse.view(b, tq, h).transpose(1, 2).contiguous()
