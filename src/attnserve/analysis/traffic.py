"""The HBM traffic of attention: bytes moved and arithmetic intensity, naive against FlashAttention against
the lower bound, and where a GPU's roofline puts each.

Counts are exact integers for one layer of self-attention over T tokens (queries = keys), batch B, every
query head, in the activation dtype (`elem_bytes`, 2 for bf16) with the softmax statistics in float32:

naive (S and P materialised: the standard algorithm of the FlashAttention paper, its Algorithms 0 and 3)
    forward   read Q, K; write S; read S, write P; read P, V; write O        b * (4 T^2 + 2 T d + 2 T dv)
    backward  P, dO -> dV; dO, V -> dP; P, dP -> dS; dS, K -> dQ; dS, Q -> dK  b * (7 T^2 + 4 T d + 4 T dv)

flash (the paper's Algorithms 1 and 4, tile Bc = ceil(M / 4d), Br = min(Bc, d) from M on-chip elements)
    forward   O, l, m initialised in HBM; K_j, V_j read once; for every (i, j) block pair that is visited
              (all of them, or those with a visible key when causal) Q_i, O_i, l_i, m_i read and O_i, l_i, m_i
              written: Theta(T^2 d^2 / M)
    backward  dQ, dK, dV initialised; K_j, V_j read and dK_j, dV_j written once; per visited pair Q_i, O_i,
              dO_i, dQ_i, l_i, m_i read and dQ_i written
    (`order="rows"` counts the loop order of attnserve's kernels instead: query blocks outer, each K/V block
    read once per visited pair, Q and O once, the row LSE written once; the backward reads Q, dO, LSE and
    delta once per visited pair from the key-block side and K, V once per visited pair from the query side.)

lower bound (every input read once, every output written once)
    forward   Q, K, V in; O out
    backward  Q, K, V, O, dO in; dQ, dK, dV out
    With GQA the lower bound reads K and V once per KV head; the naive and flash forms read them once per
    query head, as their kernels do.

FLOPs count the useful work only: 2 (d + dv) per visible (query, key) pair forward (QK^T and PV); backward
2 (2 d + 2 dv) per pair for the naive form (dV, dP, dQ, dK) and 2 (3 d + 2 dv) for the others (S recomputed).
Causal attention has T (T + 1) / 2 visible pairs. The roofline: attainable = min(peak, intensity * bandwidth).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from attnserve.hardware import PRESET_HARDWARE, Hardware, detect_hardware
from attnserve.shape import AttentionShape

STAT_BYTES = 4  # softmax statistics (l, m, LSE, delta) are float32

# Datasheet ceilings by `attnserve.hardware.PRESET_HARDWARE` key: dense bf16 tensor TFLOP/s, HBM TB/s, and the
# on-chip memory one multiprocessor (CU) offers a kernel's tiles (shared memory / LDS), KiB.
GPU_CEILINGS: dict[str, tuple[float, float, int]] = {
    "h100": (989.0, 3.35, 228),
    "h200": (989.0, 4.8, 228),
    "h20": (148.0, 4.0, 228),
    "b200": (2250.0, 8.0, 228),
    "gb300": (2500.0, 8.0, 228),
    "rtx5090": (209.5, 1.79, 100),
    "a100": (312.0, 2.039, 164),
    "l4": (121.0, 0.3, 100),
    "mi300": (1307.0, 5.3, 64),
    "mi355": (2500.0, 8.0, 160),
}
FORMS = ("naive", "flash", "lower_bound")
ORDERS = ("paper", "rows")


@dataclass(frozen=True)
class GPU:
    """What the roofline needs of a GPU: its peak dense matrix rate, HBM bandwidth and on-chip memory."""

    name: str
    peak_tflops: float
    hbm_tb_s: float
    sram_kib: int

    @property
    def ridge(self) -> float:
        """FLOP per byte above which a kernel is compute-bound."""
        return self.peak_tflops / self.hbm_tb_s


def gpu_ceilings(name: str | None = None) -> GPU:
    """A preset by key (h100, h200, ...), or with no name the GPU this machine has (detected)."""
    if name is None:
        hw = detect_hardware()
        if hw.device == "cpu":
            raise ValueError("no GPU here: name one with --gpu (" + ", ".join(sorted(GPU_CEILINGS)) + ")")
        key = _preset_for(hw)
    else:
        key = name.lower()
        if key not in GPU_CEILINGS:
            raise ValueError(f"no roofline figures for GPU {name!r}; known: {', '.join(sorted(GPU_CEILINGS))}")
    peak, bw, sram = GPU_CEILINGS[key]
    return GPU(PRESET_HARDWARE[key].name, peak, bw, sram)


def _preset_for(hw: Hardware) -> str:
    """The preset whose name the detected device's name contains (the longest match: "H200" before "H20")."""
    found = [k for k in GPU_CEILINGS if PRESET_HARDWARE[k].name.split()[-1].lower() in hw.name.lower()]
    if not found:
        raise ValueError(f"no roofline figures for {hw.name!r}; name a preset with --gpu")
    return max(found, key=lambda k: len(PRESET_HARDWARE[k].name))


@dataclass(frozen=True)
class Tile:
    br: int  # query rows per block
    bc: int  # keys per block


def paper_tile(sram_bytes: int, head_dim: int, elem_bytes: int = 2) -> Tile:
    """The FlashAttention paper's block sizes for M = sram_bytes / elem_bytes on-chip elements:
    Bc = ceil(M / 4d), Br = min(Bc, d)."""
    m = sram_bytes // elem_bytes
    bc = -(-m // (4 * head_dim))
    if bc < 1:
        raise ValueError("on-chip memory too small for one row")
    return Tile(br=min(bc, head_dim), bc=bc)


def visible_pairs(t: int, causal: bool) -> int:
    return t * (t + 1) // 2 if causal else t * t


def _visited_rows(t: int, tile: Tile, causal: bool) -> int:
    """Sum over visited (query block i, key block j) pairs of block i's row count. A pair is visited when some
    row of block i sees some key of block j (every pair without causal)."""
    total = 0
    for i0 in range(0, t, tile.br):
        rows = min(tile.br, t - i0)
        last_row = i0 + rows - 1
        blocks = -(-t // tile.bc) if not causal else last_row // tile.bc + 1
        total += rows * blocks
    return total


def _visited_keys(t: int, tile: Tile, causal: bool) -> int:
    """Sum over visited (i, j) pairs of block j's key count."""
    total = 0
    for j0 in range(0, t, tile.bc):
        keys = min(tile.bc, t - j0)
        first_block = 0 if not causal else j0 // tile.br  # query blocks whose last row reaches key j0
        total += keys * (-(-t // tile.br) - first_block)
    return total


@dataclass(frozen=True)
class Form:
    """One form's bytes and FLOPs for one layer, and where the roofline puts it."""

    bytes: int
    flops: int
    intensity: float
    attainable_tflops: float
    bound: str  # "memory" or "compute"
    time_us: float  # max(bytes / bandwidth, flops / peak)


@dataclass(frozen=True)
class TrafficReport:
    """Everything `attnserve traffic` prints; `as_dict()` is its --json output."""

    model: str
    gpu: str
    seq_len: int
    batch: int
    causal: bool
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    elem_bytes: int
    sram_kib: int
    tile_br: int
    tile_bc: int
    order: str
    peak_tflops: float
    hbm_tb_s: float
    ridge: float
    score_matrix_bytes_per_head: int  # one T x T matrix (S, or P) of one head of one sequence
    forward: dict[str, Form] = field(default_factory=dict)
    backward: dict[str, Form] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def forward_bytes(t: int, d: int, dv: int, b: int, tile: Tile, causal: bool, hq: int = 1, hkv: int = 1,
                  order: str = "paper") -> dict[str, int]:
    """Forward HBM bytes of each form for one sequence of t tokens and hq query heads (hkv KV heads)."""
    naive = b * (4 * t * t + 2 * t * d + 2 * t * dv) * hq
    if order == "paper":
        rows = _visited_rows(t, tile, causal)
        init = b * t * dv + 2 * STAT_BYTES * t
        once = b * t * (d + dv)
        per_pair = rows * (b * (d + 2 * dv) + 4 * STAT_BYTES)
        flash = (init + once + per_pair) * hq
    elif order == "rows":
        keys = _visited_keys(t, tile, causal)
        flash = (b * t * (d + dv) + STAT_BYTES * t + keys * b * (d + dv)) * hq
    else:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    lower = b * t * (hq * (d + dv) + hkv * (d + dv))
    return {"naive": naive, "flash": flash, "lower_bound": lower}


def backward_bytes(t: int, d: int, dv: int, b: int, tile: Tile, causal: bool, hq: int = 1, hkv: int = 1,
                   order: str = "paper", dq_tile: Tile | None = None) -> dict[str, int]:
    """Backward HBM bytes of each form for one sequence of t tokens and hq query heads (hkv KV heads).
    With order="rows", `tile` is the key-block kernel's and `dq_tile` (default: the same) the query-block one's."""
    naive = b * (7 * t * t + 4 * t * d + 4 * t * dv) * hq
    if order == "paper":
        rows = _visited_rows(t, tile, causal)
        init = b * t * (2 * d + dv)
        once = 2 * b * t * (d + dv)
        per_pair = rows * (b * (3 * d + 2 * dv) + 2 * STAT_BYTES)
        flash = (init + once + per_pair) * hq
    elif order == "rows":
        keys, rows = _visited_keys(t, dq_tile or tile, causal), _visited_rows(t, tile, causal)
        delta = b * t * 2 * dv + STAT_BYTES * t  # read O and dO, write delta
        dkdv = b * t * 2 * (d + dv) + rows * (b * (d + dv) + 2 * STAT_BYTES)  # K, V in, dK, dV out; Q, dO, LSE, delta
        dq = b * t * (2 * d + dv) + 2 * STAT_BYTES * t + keys * b * (d + dv)  # Q, dO, LSE, delta in, dQ out; K, V
        flash = (delta + dkdv + dq) * hq
    else:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    lower = b * t * (hq * (2 * d + 2 * dv) + hkv * (2 * d + 2 * dv))
    return {"naive": naive, "flash": flash, "lower_bound": lower}


def _form(nbytes: int, flops: int, gpu: GPU) -> Form:
    intensity = flops / nbytes
    attainable = min(gpu.peak_tflops, intensity * gpu.hbm_tb_s)
    time_us = max(nbytes / (gpu.hbm_tb_s * 1e12), flops / (gpu.peak_tflops * 1e12)) * 1e6
    return Form(nbytes, flops, intensity, attainable, "memory" if intensity < gpu.ridge else "compute", time_us)


def traffic_report(model: str, shape: AttentionShape, seq_len: int, batch: int, gpu: GPU, causal: bool = True,
                   elem_bytes: int = 2, tile: Tile | None = None, order: str = "paper") -> TrafficReport:
    """Forward and backward traffic of one attention layer of `shape` at seq_len tokens x batch on `gpu`."""
    for name, value in (("seq_len", seq_len), ("batch", batch), ("elem_bytes", elem_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    d, dv, hq, hkv = shape.head_dim, shape.v_head_dim, shape.num_q_heads, shape.num_kv_heads
    tile = tile or paper_tile(gpu.sram_kib * 1024, d, elem_bytes)
    pairs = visible_pairs(seq_len, causal) * batch * hq
    fwd_flops = 2 * (d + dv) * pairs
    bwd_flops = {"naive": 2 * (2 * d + 2 * dv) * pairs, "flash": 2 * (3 * d + 2 * dv) * pairs}
    bwd_flops["lower_bound"] = bwd_flops["flash"]
    fb = forward_bytes(seq_len, d, dv, elem_bytes, tile, causal, hq, hkv, order)
    bb = backward_bytes(seq_len, d, dv, elem_bytes, tile, causal, hq, hkv, order)
    return TrafficReport(
        model=model, gpu=gpu.name, seq_len=seq_len, batch=batch, causal=causal, num_layers=shape.num_layers,
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, v_head_dim=dv, elem_bytes=elem_bytes,
        sram_kib=gpu.sram_kib, tile_br=tile.br, tile_bc=tile.bc, order=order, peak_tflops=gpu.peak_tflops,
        hbm_tb_s=gpu.hbm_tb_s, ridge=gpu.ridge, score_matrix_bytes_per_head=seq_len * seq_len * elem_bytes,
        forward={f: _form(fb[f] * batch, fwd_flops, gpu) for f in FORMS},
        backward={f: _form(bb[f] * batch, bwd_flops[f], gpu) for f in FORMS},
    )


def bytes_against_t(shape: AttentionShape, seq_lens: list[int], gpu: GPU, causal: bool = True, elem_bytes: int = 2,
                    tile: Tile | None = None, order: str = "paper") -> dict[str, list[int]]:
    """Forward bytes of each form (batch 1, one layer) at each sequence length: the PNG's series."""
    tile = tile or paper_tile(gpu.sram_kib * 1024, shape.head_dim, elem_bytes)
    out: dict[str, list[int]] = {f: [] for f in FORMS}
    for t in seq_lens:
        fb = forward_bytes(t, shape.head_dim, shape.v_head_dim, elem_bytes, tile, causal, shape.num_q_heads,
                           shape.num_kv_heads, order)
        for f in FORMS:
            out[f].append(fb[f])
    return out


__all__ = ["FORMS", "GPU", "GPU_CEILINGS", "ORDERS", "Form", "Tile", "TrafficReport", "backward_bytes",
           "bytes_against_t", "forward_bytes", "gpu_ceilings", "paper_tile", "traffic_report", "visible_pairs"]
