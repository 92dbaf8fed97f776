"""Compile the training kernels (analysis.training.kernels) for sm_90 without a GPU and read what ptxas says.

For each kernel and tile: registers a thread, bytes spilled, shared memory, and the TMA loads and reductions and
`mma.sync` instructions in the PTX (compile_mla_sm90.compile_sm90 does the compiling). The backward kernels hold
two [BLOCK, head_dim] float32 accumulators (dK and dV) or one (dQ) next to their operands, so at head_dim 128
they sit at the 255-register ceiling; the spills say which tiles pay for it, before any GPU time is spent
racing them.

    python3 tools/compile_training_sm90.py [--tiles dkdv:32,128,8,3 dq:128,64,8,3,2 ...] [--head-dim 128]
        [--not-causal] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton.language as tl  # noqa: E402
from compile_mla_sm90 import compile_sm90  # noqa: E402

from attnserve.analysis.training import kernels  # noqa: E402

KERNELS = {"fwd": kernels._fwd_kernel, "dkdv": kernels._dkdv_kernel, "dq": kernels._dq_kernel}
# every tensor bf16 but the float32 row vectors and dQ accumulator; the two float scalars
TYPES = {**{n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")},
         **{n: "*fp32" for n in ("LSE", "DELTA", "DQ_ACC")}, "sm_scale": "fp32", "softcap": "fp32"}
DEFAULT_TILES = ["dkdv:32,128,8,3", "dkdv:32,128,8,3,2", "dkdv:32,128,8,3,1,1", "dkdv:32,128,8,3,1,0,1",
                 "dq:128,64,8,3", "dq:128,64,8,3,2", "dq:128,64,8,3,1,1"]
REPORTED = ("registers", "spill_bytes", "smem_kib", "tma_loads", "tma_reductions", "mma_sync", "async_copies")


def compile_tile(kernel: str, tile: tuple[int, ...], head_dim: int = 128, causal: bool = True) -> dict:
    constexprs = {"HEAD_DIM": head_dim, "CAUSAL": causal, "WINDOW": False, "SOFTCAP": False,
                  "ACC_DTYPE": tl.float32, "BLOCK_M": tile[0], "BLOCK_N": tile[1]}
    if kernel != "fwd":
        full = kernels._full(tile)
        constexprs |= {"DIAG_SPLIT": full[4], "DESC": bool(full[5])}
    if kernel == "dkdv":
        constexprs |= {"DQ_FUSED": bool(kernels._full(tile)[6]), "TMA_REDUCE": True}
    row = {"kernel": kernel, "tile": list(tile), "head_dim": head_dim, "causal": causal}
    try:
        report = compile_sm90(KERNELS[kernel], constexprs, tile[2], tile[3], pointers=TYPES)
    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is the finding
        return row | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return row | {k: report[k] for k in REPORTED}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", nargs="*", default=DEFAULT_TILES,
                   help="kernel:BLOCK_M,BLOCK_N,warps,stages[,diagonal split[,descriptors (1: TMA loads)[,fused dQ "
                        "(dkdv)]]] (kernel: fwd, dkdv or dq)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--not-causal", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    args = p.parse_args(argv)
    for text in args.tiles:
        kernel, _, numbers = text.partition(":")
        row = compile_tile(kernel, tuple(int(x) for x in numbers.split(",")), args.head_dim, not args.not_causal)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{kernel:5s} {str(tuple(row['tile'])):22s} " + (row["error"] if "error" in row else
                  f"{row['registers']} registers, {row['spill_bytes']} bytes spilled (stores, loads), "
                  f"{row['smem_kib']} KiB shared, {row['tma_loads']} TMA loads, {row['tma_reductions']} TMA "
                  f"reductions, {row['mma_sync']} mma.sync, {row['async_copies']} async copies"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
