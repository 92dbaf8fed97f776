"""Compile the Gluon prefill kernel for sm_90 on a machine without a GPU and read what ptxas says of it.

Gluon does not run under the Triton interpreter, so this is the CPU's check of the kernel: that it
builds for Hopper at all, its registers and spills (ptxas), shared memory, and the wgmma and TMA
instructions in its PTX. The GPU tests check what it computes.

    PYTHONPATH=src python3 tools/compile_prefill_gluon_sm90.py [--dtype fp16] [--group 4]
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
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from attnserve.attention.kernels.mha import prefill_gluon as pg


def compile_report(dtype: torch.dtype = torch.bfloat16, group: int = 4, head_dim: int = 128,
                   pingpong: bool = False) -> dict:
    kv_heads = 8
    rows = torch.empty(4096, kv_heads * group, head_dim, dtype=dtype)  # stands in for q (and k / v below)
    kv = torch.empty(4096, kv_heads, head_dim, dtype=dtype)
    idx = torch.empty(16, dtype=torch.int32)
    args = dict(q_desc=pg._descriptor(rows, pg.BLOCK_M // 2), k_desc=pg._descriptor(kv, pg.BLOCK_N),
                v_desc=pg._descriptor(kv, pg.BLOCK_N), Out=rows, tile_req=idx, tile_m0=idx, qo_indptr=idx,
                kv_starts=idx, seq_lens=idx, qk_scale_log2=0.1, stride_ot=4096, stride_oh=128, num_work=1000)
    constexprs = dict(NUM_HEADS=kv_heads * group, NUM_KV_HEADS=kv_heads, BLOCK_M=pg.BLOCK_M, BLOCK_N=pg.BLOCK_N,
                      HEAD_DIM=head_dim, STAGES=pg.STAGES, CONSUMER_REGS=pg.CONSUMER_REGS,
                      PINGPONG=pingpong)
    fn = pg._prefill_gluon_kernel
    signature = {n: ("constexpr" if n in constexprs else mangle_type(args[n])) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ("Out", "stride_ot", "stride_oh")}
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": pg.LOADER_WARPS})
    ptx = kernel.asm["ptx"]
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", path, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True)
    info = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"dtype": str(dtype), "group": group, "pingpong": pingpong, "ptxas_rc": proc.returncode,
            "registers": int(regs.group(1)) if regs else None,
            "spill_bytes": tuple(map(int, spills.groups())) if spills else None,
            "smem_kib": round(kernel.metadata.shared / 1024, 1), "warps": kernel.metadata.num_warps,
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "wgmma_wait": len(re.findall(r"wgmma\.wait_group", ptx)),
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "mbarrier_arrives": ptx.count("mbarrier.arrive"),
            "mbarrier_waits": ptx.count("mbarrier.try_wait"), "local_memory": "ld.local" in ptx or "st.local" in ptx,
            "setmaxnreg": sorted({" ".join(m.split()) for m in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx)}),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in info,
            "ptxas_warnings": [ln for ln in info.splitlines() if "warning" in ln.lower()][:5]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--pingpong", action="store_true", help="the consumers taking turns to issue their MMAs")
    args = p.parse_args(argv)
    rep = compile_report(torch.bfloat16 if args.dtype == "bf16" else torch.float16, args.group, pingpong=args.pingpong)
    print(json.dumps(rep))
    return 0 if rep["ptxas_rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
