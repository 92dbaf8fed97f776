"""Programmatic dependent launch (PDL) on a chain of small dependent Triton kernels, as a decode step at batch 1
runs them: does overlapping one kernel's launch with its predecessor's tail pay, inside a CUDA graph?

A batch-1 decode step is hundreds of kernels of a few microseconds each; the gap between two of them is a
real share of the step. With PDL (Hopper and later) a kernel may be launched before its predecessor ends; it
waits (griddepcontrol.wait) for the predecessor's completion and memory before touching memory, so only the
launch and the programs' start overlap. Three ways, the same chain, each a CUDA graph, checked equal:

- off: plain launches;
- wait: PDL launches, each kernel waiting first thing (the predecessor triggers its dependents at its end);
- wait+trigger: each kernel also lets its dependents launch right after its own wait.

Chains: `one` (one program a kernel, like an RMSNorm of one token), `wide` (132 programs, like a GEMV), and
`mixed` (every third kernel a cuBLAS GEMV that does not take part in PDL). Microseconds per kernel.

    PYTHONPATH=src python3 benchmarks/pdl_chain_gpu.py --out pdl_chain_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from attnserve.bench.timing import time_graph
from attnserve.versions import package_versions

WIDTH = 2048  # elements a program reads and writes (one token's hidden state)


@triton.jit
def _step_kernel(X, Y, scale, WIDTH: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """Y[p] = X[p] * scale + 1 for this program's row p: one dependent step of the chain."""
    if PDL:
        gdc_wait()  # the predecessor's writes are visible past this point
        if TRIGGER:
            gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64) * WIDTH
    offs = tl.arange(0, WIDTH)
    x = tl.load(X + row + offs).to(tl.float32)
    tl.store(Y + row + offs, (x * scale + 1.0).to(Y.dtype.element_ty))


def chain(kind: str, length: int, rows: int, mode: str, bufs, gemv_w):
    pdl, trigger = mode != "off", mode == "wait+trigger"

    def run():
        a, b = bufs
        for i in range(length):
            if kind == "mixed" and i % 3 == 2:
                torch.mm(a, gemv_w, out=b)  # [rows, WIDTH] @ [WIDTH, WIDTH]: cuBLAS, no PDL
            else:
                _step_kernel[(rows,)](a, b, 0.5, WIDTH=WIDTH, PDL=pdl, TRIGGER=trigger, num_warps=4,
                                      launch_pdl=pdl)
            a, b = b, a
        return a
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=300, help="kernels in the chain")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("PDL needs an SM90 or later GPU")
    rows_of = {"one": 1, "wide": torch.cuda.get_device_properties(0).multi_processor_count, "mixed": 1}
    results = []
    for kind, rows in rows_of.items():
        gemv_w = torch.randn(WIDTH, WIDTH, device="cuda", dtype=torch.bfloat16) / WIDTH  # [WIDTH, WIDTH]
        row = {"chain": kind, "programs": rows, "kernels": args.length}
        outs = {}
        x0 = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16)  # [rows, WIDTH]
        for mode in ("off", "wait", "wait+trigger"):
            bufs = (x0.clone(), torch.empty_like(x0))
            fn = chain(kind, args.length, rows, mode, bufs, gemv_w)
            outs[mode] = fn().clone()  # eager, once, from x0

            def replay(fn=fn, bufs=bufs, x0=x0):
                bufs[0].copy_(x0)
                fn()
            row[f"{mode}_us_per_kernel"] = round(time_graph(replay, calls_per_graph=3) / args.length, 3)
        row["same_outputs"] = all(torch.equal(outs["off"], o) for o in outs.values())
        row["wait_speedup"] = round(row["off_us_per_kernel"] / row["wait_us_per_kernel"], 3)
        row["wait+trigger_speedup"] = round(row["off_us_per_kernel"] / row["wait+trigger_us_per_kernel"], 3)
        print(json.dumps(row), flush=True)
        results.append(row)
    report = {"what": __doc__.splitlines()[0], "gpu": torch.cuda.get_device_name(), "versions": package_versions(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rows": results,
              "command": "PYTHONPATH=src python3 benchmarks/pdl_chain_gpu.py --out OUT"}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
