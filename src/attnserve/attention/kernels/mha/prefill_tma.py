"""Prefill / extend over contiguous K/V rows through TMA tensor descriptors, warp-specialised on Hopper.

The paged extend kernel (mha/extend.py) gathers every key through the page table, which rules out
TMA and, with it, Triton's Hopper warp specialisation. This kernel reads K and V as ragged
contiguous rows instead: request r's keys are rows kv_starts[r] .. kv_starts[r] + seq_lens[r]
of a `[rows, Hkv, D]` tensor. For fresh prompts those rows are the call's own k and v (no copy);
with a cached prefix the backend first gathers each request's keys from the pool into one such
tensor (`gather_request_rows`: one read and one write of K and V, small beside the attention itself).

Each program owns BLOCK_M query rows of one query head. Q, K and V tiles arrive through tensor
descriptors; on sm90 the key loop is `tl.range(..., warp_specialize=True)`, which Triton 3.6
turns into one producer warpgroup issuing the TMA loads and two consumer warpgroups of
BLOCK_M / 2 rows each (FlashAttention-3's layout; `num_warps` counts one warpgroup, the
kernel launches 12 warps). The sm90 default at head_dim 128 is persistent: one program per SM
walks the (query tile, head) work list, and that loop is the specialised one. Triton 3.6's Hopper
warp specialisation takes no second loop beside the specialised one (before or after, it aborts
in a dominance assertion; a nested loop is fine), so the causal / window mask is built on every
key tile rather than in a separate diagonal loop; it needs descriptors built in the kernel
(host ones hang) and no pointer loads (check_warp_specialized says which configs are refused).

Rows past a request's end inside a tile read the next request's rows (or zeros past the
tensor's end, which TMA fills); the mask hides those keys and the output store is masked, so
they never reach a result. The same source runs under TRITON_INTERPRET=1 (the interpreter
implements tensor descriptors, zero fill included) with a float32 dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels.common import (
    LOG2E,
    dot_dtype_is_f32,
    dot_pv,
    dot_qk,
    online_softmax_start,
    online_softmax_tile,
    online_softmax_tile_fma,
    to_log2,
)
from attnserve.attention.kernels.extend_tiles import ExtendTiles
from attnserve.attention.kernels.gpu_target import GpuTarget, TileShape, check_shared_memory
from attnserve.attention.kernels.params import LayerParams
from attnserve.transfers import to_device


@dataclass(frozen=True)
class PrefillTmaConfig:
    block_m: int = 128  # query rows per program; two consumer warpgroups take half each when warp-specialised
    block_n: int = 128  # keys per TMA tile
    num_warps: int = 8  # with warp specialisation: one warpgroup, Triton adds the producer and the second consumer
    num_stages: int = 2  # K/V tiles in flight
    warp_specialize: bool = False
    # build the causal mask on every key tile (True) or only on the diagonal's, decided per tile at run time
    mask_every_tile: bool = True
    # one program per SM over the whole work list (0: one program per (head, tile)); programs per SM when > 0
    persistent: int = 0
    # descriptors built by the kernel (needed with warp specialisation, see _prefill_tma_kernel) or on the host
    device_descriptors: bool = False
    # persistent work list order: query heads fastest over the tiles (False), or KV head by KV head, each one's
    # tiles heaviest first with its query heads fastest (True), so the programs in flight read one KV head's keys
    kv_head_major: bool = False

    def positions_per_tile(self, group: int) -> int:
        """Query positions per tile (one head per program), the ExtendTiles contract."""
        return self.block_m


# sm90 defaults per head_dim: at head_dim 128 the warp-specialised persistent kernel, the fastest on every
# prefill and extend shape; other head dims take the unspecialised kernel's best tiles (warp-specialised tiles
# are allowed only where they were measured correct: see check_warp_specialized).
PREFILL_TMA_TILES = {
    128: PrefillTmaConfig(128, 128, 4, 2, True, persistent=1, device_descriptors=True),
    64: PrefillTmaConfig(128, 64, 8, 3, False),
    256: PrefillTmaConfig(128, 64, 8, 2, False),  # 192 KiB of shared memory: 3 stages would not fit
}
INTERPRETER_PREFILL_TMA_TILES = PrefillTmaConfig(block_m=16, block_n=16, num_warps=4, num_stages=1,
                                                 warp_specialize=False)


def default_prefill_tma_config(head_dim: int, device: torch.device) -> PrefillTmaConfig:
    if torch.device(device).type != "cuda":
        return INTERPRETER_PREFILL_TMA_TILES
    return PREFILL_TMA_TILES[head_dim]


def check_warp_specialized(config: PrefillTmaConfig, head_dim: int) -> None:
    """Refuse the warp-specialised configs Triton 3.6 builds wrongly on Hopper (before anything runs).

    With host descriptors the first launch never finishes (the
    query tile's TMA box is not split with the tile); with 64-key tiles over 3 stages every output is
    NaN; a run-time branch in the key loop silently drops the specialisation. Only the shape measured
    correct is allowed: device descriptors, 128-key tiles, 2 stages, head_dim 128, the mask on every tile.
    """
    if not config.warp_specialize:
        return
    problems = []
    if not config.device_descriptors:
        problems.append("host descriptors (the kernel hangs)")
    if (config.block_m, config.block_n, config.num_stages) != (128, 128, 2):
        problems.append(f"tiles {config.block_m}x{config.block_n} over {config.num_stages} stages "
                        "(only 128x128 over 2 stages is correct here; 128x64 over 3 gives NaN)")
    if head_dim != 128:
        problems.append(f"head_dim {head_dim} (checked at 128 only)")
    if not config.mask_every_tile:
        problems.append("mask_every_tile=False (a run-time branch in the key loop is not specialised)")
    if problems:
        raise ValueError("warp-specialised prefill config refused: " + "; ".join(problems))


def tma_rows_ok(t: torch.Tensor) -> bool:
    """A `[rows, heads, dim]` tensor a 2-D descriptor over `[rows, heads * dim]` can read.

    Heads adjacent within a row (a view of a fused projection is fine), the last dimension
    contiguous, the base and the row stride 16-byte aligned (what TMA requires).
    """
    if t is None or t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        return False
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def gather_request_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Every request's keys (or values) as contiguous rows: `[len(slots), H, D]` from the pool's `[slots, H, D]`."""
    return buffer.index_select(0, slots)


def request_slots(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, seq_lens: list[int], page_size: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool slots of every request's keys in order, `[sum(seq_lens)]` int32, and each request's first row `[B]`.

    Host-side lengths size everything, and only the [B] lengths and starts travel (through pinned memory):
    nothing waits for the device, so the step in flight keeps running while this one is launched.
    """
    total = sum(seq_lens)
    starts = [0]
    for s in seq_lens[:-1]:
        starts.append(starts[-1] + s)
    device = torch.device(device)
    lens_t = to_device(seq_lens, device)  # [B] int64
    starts_t = to_device(starts, device)  # [B] int64
    req = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens_t, output_size=total)  # [total]
    pos = torch.arange(total, device=device) - starts_t[req]  # [total] position within the request
    page = kv_indices.long()[kv_indptr.long()[req] + pos // page_size]  # [total]
    slots = page * page_size + pos % page_size  # [total]
    return slots.to(torch.int32), starts_t.to(torch.int32)  # (a pool's slots number under 2^31)


@triton.jit
def _attend_tile(
    desc_q, desc_k, desc_v, Out, Lse, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, Sinks, t, pid_h,
    qk_scale_log2, sm_scale_k, softcap, window, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    WS_KEYS: tl.constexpr, MASK_EVERY_TILE: tl.constexpr, DOT_F32: tl.constexpr, HAS_LSE: tl.constexpr,
):
    """Query tile t (BLOCK_M positions of one request) of query head pid_h, written to Out (and with HAS_LSE
    each row's natural-log LSE to Lse, `[rows, stride_lt]` float32: what a backward recomputes P from)."""
    r = tl.load(tile_req + t)
    m0 = tl.load(tile_m0 + t)
    q_start = tl.load(qo_indptr + r)
    ext = tl.load(qo_indptr + r + 1) - q_start
    seq = tl.load(seq_lens + r)
    kv_start = tl.load(kv_starts + r)
    prefix = seq - ext
    kvh = pid_h // GROUP

    q_row = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] positions among the request's new tokens
    q_pos = prefix + q_row  # [BLOCK_M] absolute positions
    q = desc_q.load([q_start + m0, pid_h * HEAD_DIM])  # [BLOCK_M, HEAD_DIM]
    if DOT_F32:
        q = q.to(tl.float32)

    m_i, l_i, acc = online_softmax_start(BLOCK_M, HEAD_DIM)

    hi = tl.minimum(seq, prefix + m0 + BLOCK_M)  # nothing past the last row's position is visible
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    offs_n0 = tl.arange(0, BLOCK_N)
    full_end = prefix + m0 + 1  # keys below it are visible to every row of the tile
    for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WS_KEYS):
        k = desc_k.load([kv_start + n0, kvh * HEAD_DIM])  # [BLOCK_N, HEAD_DIM]
        s = dot_qk(q, k, DOT_F32)  # [BLOCK_M, BLOCK_N]
        offs_n = n0 + offs_n0
        if HAS_SOFTCAP:  # the mask must follow the soft-cap transform
            visible = offs_n[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            p, alpha, m_i, l_i = online_softmax_tile(s, visible, m_i, l_i, qk_scale_log2, sm_scale_k, softcap,
                                                     HAS_SOFTCAP, True)
        else:
            if MASK_EVERY_TILE or HAS_WINDOW:
                visible = offs_n[None, :] <= q_pos[:, None]
                if HAS_WINDOW:
                    visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
            elif n0 + BLOCK_N > full_end:  # a tile on the diagonal, masked at run time
                s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_tile_fma(s, m_i, l_i, qk_scale_log2)
        v = desc_v.load([kv_start + n0, kvh * HEAD_DIM])  # [BLOCK_N, HEAD_DIM]
        acc = dot_pv(p, v, acc * alpha[:, None], q, DOT_F32)

    if HAS_SINKS:
        sink = to_log2(tl.load(Sinks + pid_h))
        l_i += tl.exp2(tl.minimum(sink - m_i, 126.0))  # capped: no overflow when nothing is visible
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(Out + (q_start + q_row)[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :],
             o.to(Out.dtype.element_ty), mask=(q_row < ext)[:, None])
    if HAS_LSE:  # m_i and l_i are base 2: ln(sum exp(s)) = (m + log2(l)) * ln(2)
        tl.store(Lse + (q_start + q_row) * stride_lt + pid_h, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                 mask=q_row < ext)


# The kernel's sizes that change with every step's tokens. Triton would otherwise specialise a launch on each
# integer's divisibility by 16 (and on == 1), so a served mix of chunk sizes compiled new variants in the middle of
# serving: about 3 s of compiles in a 15 s run at c=64 on the H200 (benchmarks/serve_profile.sh). The TMA
# descriptors take these as shapes, where no alignment is assumed anyway.
PER_STEP_SIZES = ("num_work", "q_rows", "kv_rows")


@triton.jit(do_not_specialize=PER_STEP_SIZES)
def _prefill_tma_kernel(
    Q, K, V, Out, Lse, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, Sinks,
    qk_scale_log2, sm_scale_k, softcap, window, stride_ot, stride_oh, stride_lt, num_work,
    q_rows, kv_rows, stride_qt, stride_kt, stride_vt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, PERSISTENT: tl.constexpr, MASK_EVERY_TILE: tl.constexpr,
    DEVICE_DESC: tl.constexpr, KV_HEAD_MAJOR: tl.constexpr, DOT_F32: tl.constexpr, HAS_LSE: tl.constexpr,
):
    # Q, K, V: host-built descriptors, or with DEVICE_DESC the tensors themselves, described here. Warp
    # specialisation splits the query tile between two consumer warpgroups and loads each half with its own
    # TMA box; only a descriptor the compiler builds itself gets that box (a host descriptor keeps the whole
    # tile's, and its loads overrun the half-size buffers: the kernel never finishes).
    if DEVICE_DESC:
        desc_q = tl.make_tensor_descriptor(Q, [q_rows, NUM_HEADS * HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM])
        desc_k = tl.make_tensor_descriptor(K, [kv_rows, NUM_KV_HEADS * HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM])
        desc_v = tl.make_tensor_descriptor(V, [kv_rows, NUM_KV_HEADS * HEAD_DIM], [stride_vt, 1], [BLOCK_N, HEAD_DIM])
    else:
        desc_q = Q
        desc_k = K
        desc_v = V
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    # PERSISTENT: one program per SM walks the (tile, head) work list, heads fastest, and the work loop is the
    # warp-specialised one (the next tile's Q and keys load while this tile's last MMAs run). Otherwise one
    # program per (head, tile) and the key loop is specialised.
    if PERSISTENT:
        for w in tl.range(tl.program_id(0), num_work, tl.num_programs(0), warp_specialize=WARP_SPECIALIZE):
            if KV_HEAD_MAJOR:  # w = (kv head * tiles + tile) * GROUP + query head within the group
                per_kv_head = num_work // NUM_KV_HEADS
                t = w % per_kv_head // GROUP
                h = w // per_kv_head * GROUP + w % GROUP
            else:  # w = tile * NUM_HEADS + query head
                t = w // NUM_HEADS
                h = w % NUM_HEADS
            _attend_tile(desc_q, desc_k, desc_v, Out, Lse, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, Sinks,
                         t, h, qk_scale_log2, sm_scale_k, softcap, window,
                         stride_ot, stride_oh, stride_lt, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, HAS_WINDOW, HAS_SOFTCAP,
                         HAS_SINKS, False, MASK_EVERY_TILE, DOT_F32, HAS_LSE)
    else:
        _attend_tile(desc_q, desc_k, desc_v, Out, Lse, tile_req, tile_m0, qo_indptr, kv_starts, seq_lens, Sinks,
                     tl.program_id(1), tl.program_id(0), qk_scale_log2, sm_scale_k, softcap, window,
                     stride_ot, stride_oh, stride_lt, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, HAS_WINDOW, HAS_SOFTCAP,
                     HAS_SINKS, WARP_SPECIALIZE, MASK_EVERY_TILE, DOT_F32, HAS_LSE)


def _scratch(size: int, alignment: int, stream):
    """Global scratch for descriptors a kernel builds on the device (128 bytes each per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _descriptor(rows: torch.Tensor, block_rows: int):
    """A 2-D descriptor over `[rows, heads * dim]` whose blocks are `block_rows` rows of one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, heads, dim = rows.shape
    return TensorDescriptor(rows, [n, heads * dim], [rows.stride(0), 1], [block_rows, dim])


def prefill_tma_attention(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    kv_starts: torch.Tensor,
    out: torch.Tensor,
    tiles: ExtendTiles,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    layer: LayerParams,
    config: PrefillTmaConfig | None = None,
    target: GpuTarget | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens against their request's keys, read as contiguous rows.

    q `[T, Hq, D]`, out `[T, Hq, D]`; k_rows / v_rows `[rows, Hkv, D]` where request r's keys are rows
    kv_starts[r] .. + seq_lens[r] (`[B]` int32 each); qo_indptr `[B+1]`. Every tensor must satisfy
    `tma_rows_ok`. `tiles` must have been built with `config.block_m` positions per tile; layer: the layer's
    scale and masking (params.LayerParams; K/V scales do not apply: FP8 pools take the paged kernel).
    lse: where given, `[T, Hq]` float32 (row stride Hq) receives each row's natural-log LSE (sinks included).
    """
    sm_scale, sliding_window, logit_cap, sinks = layer.sm_scale, layer.sliding_window, layer.logit_cap, layer.sinks
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_rows.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    config = config or default_prefill_tma_config(head_dim, q.device)
    check_warp_specialized(config, head_dim)
    if tiles.positions != config.block_m:
        raise ValueError(f"tiles cover {tiles.positions} positions, the config's tiles {config.block_m}")
    for name, t in (("q", q), ("k_rows", k_rows), ("v_rows", v_rows)):
        if not tma_rows_ok(t):
            raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()} cannot be read through TMA")
    check_shared_memory("prefill_tma", TileShape(config.block_m, head_dim, config.block_n, 2 * head_dim,
                                                 config.num_stages, q.element_size()), target)
    if num_tokens == 0 or tiles.num_tiles == 0:
        return out
    sm_scale_k = sm_scale
    num_work = num_heads * tiles.num_tiles
    if config.persistent:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 2
        grid = (min(num_work, sms * config.persistent),)
    else:
        grid = (num_heads, tiles.num_tiles)
    if config.device_descriptors:
        if q.is_cuda:
            triton.set_allocator(_scratch)  # a context variable: set where the launch happens
        operands = (q, k_rows, v_rows)
    else:
        operands = (_descriptor(q, config.block_m), _descriptor(k_rows, config.block_n),
                    _descriptor(v_rows, config.block_n))
    if lse is not None and (lse.shape != (num_tokens, num_heads) or lse.dtype != torch.float32
                            or lse.stride() != (num_heads, 1)):
        raise ValueError(f"lse must be a contiguous [{num_tokens}, {num_heads}] float32 tensor, got "
                         f"{tuple(lse.shape)} {lse.dtype} with strides {lse.stride()}")
    _prefill_tma_kernel[grid](
        *operands, out, lse if lse is not None else out, tiles.tile_req, tiles.tile_m0, qo_indptr, kv_starts,
        seq_lens, sinks if sinks is not None else q, sm_scale_k * LOG2E, sm_scale_k, float(logit_cap or 1.0),
        int(sliding_window or 0), out.stride(0), out.stride(1), num_heads, num_work,
        q.shape[0], k_rows.shape[0], q.stride(0), k_rows.stride(0), v_rows.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HEAD_DIM=head_dim, HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_cap is not None,
        HAS_SINKS=sinks is not None, WARP_SPECIALIZE=config.warp_specialize, PERSISTENT=bool(config.persistent),
        MASK_EVERY_TILE=config.mask_every_tile, DEVICE_DESC=config.device_descriptors,
        KV_HEAD_MAJOR=config.kv_head_major, DOT_F32=dot_dtype_is_f32(q), HAS_LSE=lse is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
