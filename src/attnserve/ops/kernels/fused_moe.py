"""Routed experts as two grouped GEMMs over the (token, choice) pairs sorted by expert.

The pairs are aligned so that each block of block_m rows belongs to one expert (ops/moe_align.py); a program
takes one row block and one tile of output columns, reads its expert's weights where they lie and gathers
its tokens' activations. Only the experts a batch chose are read: one token over top-6 runs six row blocks.
Shared experts (DeepSeek's) are S more experts that every token takes with weight 1: a shared MLP of S * I
channels is a sum of S experts of I channels, read in place by the same two GEMMs.

1. gate and up: both halves of the expert's gate_up_proj against the same activation tile, and SiLU(gate) *
   up in the epilogue, so the [pairs, 2I] projection is never written;
2. down: the activated rows against down_proj, scaled by each pair's routing weight in the epilogue;
3. the top-k sum: each token's weighted rows in a fixed order (so a step's output does not depend on which
   program finished first, as with atomics), cast once (plus an output to add, where given).

Rounding follows the torch paths of models/moe.py: each projection is rounded to the activation dtype, SiLU
is rounded before the product, the weighted sum is in float32. Every launch's grid depends on the number of
tokens alone: CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import dot_dtype_is_f32, interpreting
from attnserve.attention.kernels.gpu_target import target_for
from attnserve.ops.kernels.moe_align import align_in_one_launch
from attnserve.ops.kernels.pdl import launch_options, wait_for_predecessor
from attnserve.ops.moe_align import ExpertAlignment, align_by_expert
from attnserve.ops.moe_tiles import INTERPRETER_TILES, GemmTile, MoETiles, tiles_for

# up to this many (token, choice) pairs the alignment is one Triton launch (kernels/moe_align.py, a program per
# expert: 9.8 us at 1024 pairs on an H200 against the torch ops' 79); above it, the torch ops of ops/moe_align.py
# (the launch is not timed beyond 1024 pairs)
ONE_LAUNCH_ALIGN_MAX_PAIRS = 1024
SUM_BLOCK = 1024  # hidden columns per program of the top-k sum


@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts' stacked weights, and shared experts run as NUM_SHARED more experts of the same width
    (a shared MLP of S * I channels is S experts of I: the sum over its channels splits into S sums)."""

    gate_up: torch.Tensor  # [E, 2I, hidden], gate rows first
    down: torch.Tensor  # [E, hidden, I]
    shared_gate_up: torch.Tensor | None = None  # [2 * S * I, hidden]: the S experts' gate rows, then their up rows
    shared_down: torch.Tensor | None = None  # [hidden, S * I]

    @property
    def num_shared(self) -> int:
        return 0 if self.shared_down is None else self.shared_down.shape[1] // self.down.shape[2]


@triton.jit
def _expert_rows(SortedPairs, BlockExpert, Ids, pid_m, num_pairs, BLOCK_M: tl.constexpr, ONE_TOKEN: tl.constexpr,
                 TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """This row block's expert and pair ids, and which rows are real pairs (the rest is padding). ONE_TOKEN: no
    alignment; block b is the token's choice b alone (a routed id from Ids, then the shared experts)."""
    if ONE_TOKEN:
        routed = tl.load(Ids + tl.minimum(pid_m, TOP_K - 1)).to(tl.int64)
        expert = tl.where(pid_m < TOP_K, routed, (NUM_EXPERTS + pid_m - TOP_K).to(tl.int64))
        rows = tl.arange(0, BLOCK_M)
        pairs = tl.where(rows == 0, pid_m, num_pairs).to(tl.int64)  # [BLOCK_M]
    else:
        expert = tl.load(BlockExpert + pid_m).to(tl.int64)
        pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    return expert, pairs, pairs < num_pairs


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # float32 models, and the interpreter (which misreads bf16 inside tl.dot)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _row_tile(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """`[BLOCK_M, BLOCK_K]` of the pairs' rows; padding rows (and columns past K) load as zeros."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _weight_tile(ptrs, k_ok, col_ok, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """`[BLOCK_K, BLOCK_N]` of an expert's weights, masked only where K or N does not divide into tiles."""
    if EVEN_K:
        if EVEN_N:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    return tl.load(ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _gate_up_silu_kernel(
    X, W, WS, Out, SortedPairs, BlockExpert, Ids,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, shared_up_rows, stride_om,
    num_pairs, K, N,
    TOP_K: tl.constexpr, CHOICES: tl.constexpr, NUM_EXPERTS: tl.constexpr, NUM_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, ONE_TOKEN: tl.constexpr, PDL: tl.constexpr,
):
    """Out[pair, n] = silu(x[token] . W[e, n]) * (x[token] . W[e, N + n]) for this block's pairs, N channels.
    Experts from NUM_EXPERTS on are the shared ones, in WS: gate rows (e - E) * N.., up rows shared_up_rows on."""
    wait_for_predecessor(PDL)
    pid_m = tl.program_id(0)
    expert, pairs, row_ok = _expert_rows(SortedPairs, BlockExpert, Ids, pid_m, num_pairs, BLOCK_M, ONE_TOKEN, TOP_K,
                                         NUM_EXPERTS)
    if expert >= NUM_EXPERTS + NUM_SHARED:  # past the last expert's rows: this batch's routing needs fewer blocks
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + (pairs // CHOICES)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    if expert < NUM_EXPERTS:
        gate_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        up_ptrs = gate_ptrs + N * stride_wn
    else:
        gate_ptrs = WS + (expert - NUM_EXPERTS) * stride_se + offs_n[None, :] * stride_sn + offs_k[:, None]
        up_ptrs = gate_ptrs + shared_up_rows * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = _row_tile(x_ptrs, row_ok, k_ok, EVEN_K)
        gate = _weight_tile(gate_ptrs, k_ok, col_ok, EVEN_K, EVEN_N)
        up = _weight_tile(up_ptrs, k_ok, col_ok, EVEN_K, EVEN_N)
        acc_gate = _dot(x, gate, acc_gate, DOT_F32)
        acc_up = _dot(x, up, acc_up, DOT_F32)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = Out.dtype.element_ty
    gate_out = acc_gate.to(dtype).to(tl.float32)
    up_out = acc_up.to(dtype).to(tl.float32)
    act = (gate_out / (1.0 + tl.exp(-gate_out))).to(dtype).to(tl.float32)
    out_ptrs = Out + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, (act * up_out).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_weighted_kernel(
    H, W, WS, Out, RoutingWeights, SortedPairs, BlockExpert, Ids,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    num_pairs, K, N,
    TOP_K: tl.constexpr, CHOICES: tl.constexpr, NUM_EXPERTS: tl.constexpr, NUM_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr, ONE_TOKEN: tl.constexpr, PDL: tl.constexpr,
):
    """Out[pair, n] (float32) = routing_weight[pair] * round(h[pair] . W[e, n]) for this block's pairs; a
    token's choices past its TOP_K routed ones are the shared experts (weight 1, columns (e - E) * K.. of WS)."""
    wait_for_predecessor(PDL)
    pid_m = tl.program_id(0)
    expert, pairs, row_ok = _expert_rows(SortedPairs, BlockExpert, Ids, pid_m, num_pairs, BLOCK_M, ONE_TOKEN, TOP_K,
                                         NUM_EXPERTS)
    if expert >= NUM_EXPERTS + NUM_SHARED:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = H + pairs[:, None] * stride_hm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    if expert < NUM_EXPERTS:
        w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    else:
        w_ptrs = WS + (expert - NUM_EXPERTS) * stride_se + offs_n[None, :] * stride_sn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        h = _row_tile(h_ptrs, row_ok, k_ok, EVEN_K)
        w = _weight_tile(w_ptrs, k_ok, col_ok, EVEN_K, EVEN_N)
        acc = _dot(h, w, acc, DOT_F32)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    choice = pairs % CHOICES
    routing = tl.load(RoutingWeights + (pairs // CHOICES) * TOP_K + choice, mask=row_ok & (choice < TOP_K),
                      other=1.0).to(tl.float32)  # [BLOCK_M]
    y = acc.to(H.dtype.element_ty).to(tl.float32) * routing[:, None]
    tl.store(Out + pairs[:, None] * stride_om + offs_n[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_top_k_kernel(Weighted, Add, Out, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr, HAS_ADD: tl.constexpr,
                      PDL: tl.constexpr):
    """Out[t] = round(sum_j Weighted[t * TOP_K + j]) (+ Add[t], rounded once more), as the torch paths round."""
    wait_for_predecessor(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(Weighted + (token * TOP_K + j) * N + offs, mask=mask, other=0.0)
    y = acc.to(Out.dtype.element_ty)
    if HAS_ADD:
        add = tl.load(Add + token * N + offs, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + add).to(Out.dtype.element_ty)
    tl.store(Out + token * N + offs, y, mask=mask)


@functools.lru_cache(maxsize=256)
def _shipped_tiles(arch: str, tokens: int, shape: tuple[tuple[str, int], ...]) -> MoETiles:
    return tiles_for(arch, tokens, dict(shape))


def moe_tiles(device: torch.device, tokens: int, experts: int, hidden: int, intermediate: int,
              top_k: int) -> MoETiles:
    """The shipped table's tiles for this GPU, batch and expert shape; the interpreter's small ones on the CPU."""
    target = target_for(device)
    if target is None or interpreting():
        return INTERPRETER_TILES
    shape = (("experts", experts), ("hidden", hidden), ("intermediate", intermediate), ("top_k", top_k))
    return _shipped_tiles(target.arch, tokens, shape)


def _check(x, w: ExpertWeights, weights, ids) -> None:
    experts, two_i, hidden = w.gate_up.shape
    if (x.dim() != 2 or x.shape[1] != hidden or w.down.shape != (experts, hidden, two_i // 2)
            or weights.shape != ids.shape or ids.shape[0] != x.shape[0]):
        raise ValueError(f"fused_experts needs x [T, hidden], gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I], "
                         f"weights and ids [T, top_k]; got x {tuple(x.shape)}, gate_up {tuple(w.gate_up.shape)}, "
                         f"down {tuple(w.down.shape)}, weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    tensors = [w.gate_up, w.down]
    if (w.shared_gate_up is None) != (w.shared_down is None):
        raise ValueError("fused_experts takes the shared experts' gate_up and down weights together")
    if w.shared_down is not None:
        channels = two_i // 2
        s_channels = w.shared_down.shape[1]
        if (s_channels % channels or w.shared_down.shape[0] != hidden
                or w.shared_gate_up.shape != (2 * s_channels, hidden)):
            raise ValueError(f"fused_experts runs shared experts of a multiple of {channels} channels: shared gate_up "
                             f"[2 * S * {channels}, {hidden}] and down [{hidden}, S * {channels}]; got "
                             f"{tuple(w.shared_gate_up.shape)} and {tuple(w.shared_down.shape)}")
        tensors += [w.shared_gate_up, w.shared_down]
    if any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"fused_experts needs one dtype for x and the weights; got {x.dtype}, "
                         f"{', '.join(str(t.dtype) for t in tensors)}")
    if x.stride(-1) != 1 or any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("fused_experts needs x and the weights contiguous in their last dimension")


def align(ids: torch.Tensor, num_experts: int, block_m: int, num_shared: int = 0, pdl: bool = False) -> ExpertAlignment:
    """The pairs aligned by expert: one launch for decode-sized batches, the torch ops above."""
    pairs = ids.shape[0] * (ids.shape[1] + num_shared)
    if pairs <= ONE_LAUNCH_ALIGN_MAX_PAIRS:
        return align_in_one_launch(ids, num_experts, block_m, num_shared, pdl=pdl)
    return align_by_expert(ids, num_experts, block_m, num_shared)


def _rows_of(a: ExpertAlignment | None, ids: torch.Tensor, choices: int, block_m: int) -> tuple:
    """(row blocks, pairs, block_m, sorted pairs, block experts, one token) for the kernels; without an
    alignment (one token) block b is choice b, and the ids stand in for the alignment's buffers."""
    if a is None:
        return choices, choices, block_m, ids, ids, True
    return a.block_expert.numel(), a.num_pairs, a.block_m, a.sorted_pairs, a.block_expert, False


def gate_up_silu(x: torch.Tensor, w: ExpertWeights, a: ExpertAlignment | None, choices: int,
                 tile: GemmTile, pdl: bool = False, ids: torch.Tensor | None = None, block_m: int = 16) -> torch.Tensor:
    """-> silu(gate) * up [P, I] in x's dtype, rows in (token, choice) order; `choices` per token. Without an
    alignment `a`, x is one token and its routed choices are `ids` [1, top_k] (contiguous), in row blocks of
    `block_m`."""
    num_experts, two_i, hidden = w.gate_up.shape
    channels = two_i // 2
    shared = w.shared_gate_up if w.num_shared else w.gate_up[0]  # [rows, hidden]; a placeholder without shared
    blocks, pairs, block_m, sorted_pairs, block_expert, one_token = _rows_of(a, ids, choices, block_m)
    activated = x.new_empty(pairs, channels)  # [P, I]
    _gate_up_silu_kernel[(blocks, triton.cdiv(channels, tile.block_n))](
        x, w.gate_up, shared, activated, sorted_pairs, block_expert, sorted_pairs if ids is None else ids,
        x.stride(0), w.gate_up.stride(0), w.gate_up.stride(1), channels * shared.stride(0), shared.stride(0),
        w.num_shared * channels, activated.stride(0),
        pairs, hidden, channels,
        TOP_K=choices - w.num_shared, CHOICES=choices, NUM_EXPERTS=num_experts, NUM_SHARED=w.num_shared,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=hidden % tile.block_k == 0, EVEN_N=channels % tile.block_n == 0, DOT_F32=dot_dtype_is_f32(x),
        ONE_TOKEN=one_token, num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
    )
    return activated


def down_weighted(activated: torch.Tensor, w: ExpertWeights, routing: torch.Tensor, a: ExpertAlignment | None,
                  choices: int, tile: GemmTile, pdl: bool = False, ids: torch.Tensor | None = None,
                  block_m: int = 16) -> torch.Tensor:
    """activated [P, I], routing weights [T, top_k] float32 contiguous -> weight * down(activated) [P, hidden]
    float32; a token's choices past top_k (the shared experts) weigh 1. Without `a`: one token, as in
    gate_up_silu."""
    num_experts, hidden, channels = w.down.shape
    shared = w.shared_down if w.num_shared else w.down[0]  # [hidden, S * I]; a placeholder without shared
    blocks, pairs, block_m, sorted_pairs, block_expert, one_token = _rows_of(a, ids, choices, block_m)
    weighted = torch.empty(pairs, hidden, dtype=torch.float32, device=activated.device)  # [P, hidden]
    _down_weighted_kernel[(blocks, triton.cdiv(hidden, tile.block_n))](
        activated, w.down, shared, weighted, routing, sorted_pairs, block_expert, sorted_pairs if ids is None else ids,
        activated.stride(0), w.down.stride(0), w.down.stride(1), channels, shared.stride(0), weighted.stride(0),
        pairs, channels, hidden,
        TOP_K=routing.shape[1], CHOICES=choices, NUM_EXPERTS=num_experts, NUM_SHARED=w.num_shared,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=channels % tile.block_k == 0, EVEN_N=hidden % tile.block_n == 0,
        DOT_F32=dot_dtype_is_f32(activated), ONE_TOKEN=one_token, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **launch_options(pdl),
    )
    return weighted


def sum_top_k(weighted: torch.Tensor, top_k: int, dtype: torch.dtype, add: torch.Tensor | None,
              pdl: bool = False) -> torch.Tensor:
    """weighted [T * top_k, hidden] float32 -> the sum of each token's rows [T, hidden] in dtype, + add [T, hidden]."""
    pairs, hidden = weighted.shape
    out = torch.empty(pairs // top_k, hidden, dtype=dtype, device=weighted.device)  # [T, hidden]
    if add is not None and (add.shape != out.shape or not add.is_contiguous()):
        raise ValueError(f"fused_experts adds a contiguous [T, hidden] {tuple(out.shape)}, got {tuple(add.shape)}")
    _sum_top_k_kernel[(out.shape[0], triton.cdiv(hidden, SUM_BLOCK))](
        weighted, add if add is not None else out, out, hidden, TOP_K=top_k, BLOCK=SUM_BLOCK, HAS_ADD=add is not None,
        num_warps=4, **launch_options(pdl))
    return out


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, tiles: MoETiles | None = None, add: torch.Tensor | None = None,
                  shared_gate_up: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                  pdl: bool = False) -> torch.Tensor:
    """x [T, hidden], gate_up_proj [E, 2I, hidden] (gate rows first), down_proj [E, hidden, I], routing weights
    and expert ids [T, top_k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x) [T, hidden] in x's dtype (SiLU).

    Shared experts join either as weights (shared_gate_up [2 * S * I, hidden], gate rows first, and shared_down
    [hidden, S * I]: S more experts every token chooses with weight 1, read by the same two GEMMs) or as an
    output `add` [T, hidden] added in the pass that sums the top-k. `pdl`: every launch with programmatic
    dependent launch (ops/kernels/pdl.py)."""
    w = ExpertWeights(gate_up_proj, down_proj, shared_gate_up, shared_down)
    _check(x, w, weights, ids)
    tokens, top_k = ids.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    if tokens == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    tiles = tiles or moe_tiles(x.device, tokens, num_experts, hidden, two_i // 2, top_k)
    choices = top_k + w.num_shared  # every token's last choices: the shared experts E, E + 1, ...
    # one token needs no alignment: each of its choices is its own row block (ONE_TOKEN in the kernels)
    a = align(ids, num_experts, tiles.block_m, w.num_shared, pdl) if tokens > 1 else None
    ids = ids.contiguous()
    activated = gate_up_silu(x, w, a, choices, tiles.gate_up, pdl, ids, tiles.block_m)
    weighted = down_weighted(activated, w, weights.float().contiguous(), a, choices, tiles.down, pdl, ids,
                             tiles.block_m)
    return sum_top_k(weighted, choices, x.dtype, add, pdl)
