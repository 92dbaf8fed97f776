"""Absorbed MLA extend as decode rows: every new token is a decode "request" over its causal horizon.

Why: in the absorbed form all query heads of a token attend to the same latent rows, so the decode kernel's
tile (a group of heads of one query token against a run of latent rows) is already an extend tile. On Hopper
that tile is the warp-specialised seesaw Gluon kernel (gluon/seesaw.py, FlashMLA's schedule). The tokens of one
request run as neighbouring programs, so their shared latent rows come from L2 after the first read.

Token i of request r (with p cached tokens) sees keys [0, p + i + 1): a prefix of r's page list. Its decode
row therefore starts where r's pages start (r's kv_indptr entry) and is p + i + 1 long; no page index is
copied. With fewer heads than the Gluon kernel's 64 rows (DeepSeek-V2-Lite's 16, or 128 heads over tensor
parallel ranks) a CTA takes several consecutive tokens of one request, each row masked to its own horizon.
The split plan is decode's, over these lengths: a few tokens over a long prefix are split, thousands are not.
Custom masks stay on extend.py's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnserve.attention.kernels.mla.attention import mla_decode_attention
from attnserve.attention.kernels.params import DecodeRows
from attnserve.attention.kernels.plan import KernelPlan
from attnserve.attention.kernels.split_plan import SplitPolicy, plan_kv_splits_array
from attnserve.transfers import to_device

MAX_ROWS = 65535  # the Gluon kernel's grid puts tokens on CUDA's second grid dimension


@dataclass
class ExtendRowsPlan:
    """One step's decode-row metadata for the new tokens (every MLA layer of the model reuses it)."""

    kv_starts: torch.Tensor  # [T] int32: offset of the token's request in kv_indices (decode's kv_indptr[b])
    seq_lens: torch.Tensor  # [T] int32: keys the token sees, its own included
    num_splits: torch.Tensor  # [T] int32 (tokens that share a CTA share their group's count)
    max_splits: int
    # (group_first [G] int32, group_ntok [G] int32, tokens): CTAs of `tokens` consecutive tokens of one request
    # (the Gluon kernel with fewer heads than its 64 rows); None: a CTA per token
    token_groups: tuple | None = None


def causal_horizons(prefix_lens: list[int], extend_lens: list[int]) -> np.ndarray:
    """`[T]` keys each new token sees: p + 1, ..., p + e for a request with p cached and e new tokens."""
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    ext = np.asarray(extend_lens, dtype=np.int64)
    first_row = np.cumsum(ext) - ext  # [B] the request's first row among the T tokens
    return np.repeat(prefix + 1 - first_row, ext) + np.arange(int(ext.sum()))


def token_groups(extend_lens: list[int], tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(first row `[G]`, token count `[G]`) of runs of at most `tokens` consecutive new tokens of one request."""
    ext = np.asarray(extend_lens, dtype=np.int64)
    per_req = -(-ext // tokens)  # [B] groups of each request
    req = np.repeat(np.arange(ext.size), per_req)  # [G]
    k = np.arange(int(per_req.sum())) - np.repeat(np.cumsum(per_req) - per_req, per_req)  # [G] index in its request
    first = (np.cumsum(ext) - ext)[req] + k * tokens
    return first, np.minimum(tokens, ext[req] - k * tokens)


def plan_extend_rows(prefix_lens: list[int], extend_lens: list[int], page_size: int, device: torch.device,
                     programs_per_split: int, policy: SplitPolicy, tokens: int = 1) -> ExtendRowsPlan:
    """From host lengths (no device sync): kv_indptr's starts repeated per token, horizons, splits; with
    tokens > 1, the CTA groups, split by their last (longest) token's horizon."""
    ext = np.asarray(extend_lens, dtype=np.int64)
    pages = -(-(np.asarray(prefix_lens, dtype=np.int64) + ext) // page_size)  # [B] as metadata.kv_indptr counts
    starts = np.repeat(np.cumsum(pages) - pages, ext)  # [T]
    horizons = causal_horizons(prefix_lens, extend_lens)  # [T]
    device = torch.device(device)
    groups = None
    if tokens > 1:
        first, ntok = token_groups(extend_lens, tokens)
        group_splits = plan_kv_splits_array(horizons[first + ntok - 1], programs_per_split, policy)  # [G]
        splits = np.repeat(group_splits, ntok)  # [T]
        groups = (to_device(first.astype(np.int32), device), to_device(ntok.astype(np.int32), device), tokens)
    else:
        splits = plan_kv_splits_array(horizons, programs_per_split, policy)  # [T]
    return ExtendRowsPlan(
        kv_starts=to_device(starts.astype(np.int32), device),
        seq_lens=to_device(horizons.astype(np.int32), device),
        num_splits=to_device(splits, device),
        max_splits=int(splits.max(initial=1)),
        token_groups=groups,
    )


def mla_extend_rows_attention(q: torch.Tensor, kv_buffer: torch.Tensor, out: torch.Tensor, rows: ExtendRowsPlan,
                              kv_indices: torch.Tensor, sm_scale: float, plan: KernelPlan,
                              kv_scale: float = 1.0) -> torch.Tensor:
    """New tokens against their causal latent KV through the MLA decode kernel of `plan`.

    q `[T, H, kv_lora_rank + rope]`, kv_buffer `[slots, 1, kv_lora_rank + rope]`, out `[T, H, kv_lora_rank]`;
    kv_indices: the step's page list (metadata.kv_indices); plan: the rows' decode kernel (token groups need the
    seesaw Gluon kernel).
    """
    if rows.seq_lens.numel() != q.shape[0]:
        raise ValueError(f"the rows plan covers {rows.seq_lens.numel()} tokens, q has {q.shape[0]}")
    decode_rows = DecodeRows(rows.kv_starts, kv_indices, rows.seq_lens, rows.num_splits, rows.max_splits,
                             plan.signature.page_size, rows.token_groups)
    return mla_decode_attention(q, kv_buffer, out, decode_rows, plan, sm_scale, kv_scale)
