"""Compile the training kernels (analysis.training.kernels) for sm_90 without a GPU and read what ptxas says.

For each kernel and tile: registers a thread, bytes spilled a thread, shared memory, and the wgmma and cp.async
instructions in the PTX. The backward kernels hold two [BLOCK, head_dim] float32 accumulators (dK and dV) or one
(dQ) next to their operands, so at head_dim 128 they sit at the 255-register ceiling; the spills say which tiles
pay for it, before any GPU time is spent racing them.

    PYTHONPATH=src python3 tools/compile_training_sm90.py [--tiles dkdv:32,128,8,3 dq:128,64,8,3,2 ...]
        [--head-dim 128] [--not-causal] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from attnserve.analysis.training import kernels

KERNELS = {"fwd": kernels._fwd_kernel, "dkdv": kernels._dkdv_kernel, "dq": kernels._dq_kernel}
DEFAULT_TILES = ["dkdv:32,128,8,3", "dkdv:32,128,8,3,2", "dkdv:32,128,8,3,1,1", "dkdv:32,128,8,3,1,0,1",
                 "dq:128,64,8,3", "dq:128,64,8,3,2", "dq:128,64,8,3,1,1"]


def compile_tile(kernel: str, tile: tuple[int, ...], head_dim: int = 128, causal: bool = True) -> dict:
    fn = KERNELS[kernel]
    constexprs = {"HEAD_DIM": head_dim, "CAUSAL": causal, "WINDOW": False, "SOFTCAP": False,
                  "ACC_DTYPE": tl.float32, "BLOCK_M": tile[0], "BLOCK_N": tile[1]}
    if kernel != "fwd":
        full = kernels._full(tile)
        constexprs["DIAG_SPLIT"] = full[4]
        constexprs["DESC"] = bool(full[5])
    if kernel == "dkdv":
        constexprs["DQ_FUSED"] = bool(kernels._full(tile)[6])
        constexprs["TMA_REDUCE"] = True
    half, single = torch.empty(16, dtype=torch.bfloat16), torch.empty(16, dtype=torch.float32)
    args = {}
    for name in fn.arg_names:  # tensors: upper-case names (LSE, DELTA in float32); sizes and strides: ints
        if name in constexprs:
            continue
        if name in ("LSE", "DELTA", "DQ_ACC"):
            args[name] = single
        elif name.isupper() and name not in ("H", "HK", "GROUP"):
            args[name] = half
        elif name in ("sm_scale", "softcap"):
            args[name] = 0.1
        else:
            args[name] = 1 if name == "GROUP" else 1000
    sig = {n: ("constexpr" if n in constexprs else mangle_type(args[n])) for n in fn.arg_names}
    row = {"kernel": kernel, "tile": list(tile), "head_dim": head_dim, "causal": causal}
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": tile[2], "num_stages": tile[3]})
    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is the finding
        return row | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True, check=False)
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", res.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    ptx = k.asm["ptx"]
    return row | {"registers": int(regs[0]) if regs else None, "spill_bytes": int(spills[0]) if spills else None,
                  "shared_kib": round(k.metadata.shared / 1024, 1), "wgmma": ptx.count("wgmma.mma_async"),
                  "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                  "tma_loads": ptx.count("cp.async.bulk.tensor"), "global_loads": ptx.count("ld.global"),
                  "tma_reductions": ptx.count("cp.reduce.async.bulk.tensor"), "mma_sync": ptx.count("mma.sync")}


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
                  f"{row['registers']} registers, {row['spill_bytes']} bytes spilled, {row['shared_kib']} KiB shared, "
                  f"{row['wgmma']} wgmma, {row['cp_async']} cp.async, {row['tma_loads']} TMA loads, "
                  f"{row['global_loads']} ld.global, {row['tma_reductions']} TMA reductions, {row['mma_sync']} mma.sync"),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
