"""Kernels in the column-split MLA decode kernel's place, timed in one process on the race's 128-head decode
workloads, each through the triton backend as the race calls it (split plan, merge, CUDA graph), FlashInfer MLA
fa3 beside them when installed. Interleaved repetitions, so that drift over the run hits every kernel alike.
Every kernel's output is compared with the float32 oracle first.

Kernels: "colsplit" (mla_decode_colsplit.py, as shipped), "scorer" (mla_decode_scorer.py: one warpgroup scores,
the other copies, both multiply), each with the column-split kernel's arguments and grid.

    PYTHONPATH=src python3 benchmarks/mla_colsplit_variants.py [--reps 3] [--json out.json] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import sys

from mla_split_cost import write_json  # a sibling script

import attnserve.attention.kernels.mla_decode_gluon as gluon_host
from attnserve.attention.kernels.mla_decode_scorer import _mla_decode_scorer_kernel
from attnserve.bench.kernels import _oracle, _rel_err
from attnserve.bench.racers import attnserve_racer, build_race_batch, flashinfer_mla_racer, output_rows
from attnserve.bench.timing import time_call
from attnserve.bench.workloads import MLA_WORKLOADS

COLSPLIT_KERNEL = gluon_host._mla_decode_colsplit_kernel
VARIANTS = {"colsplit": COLSPLIT_KERNEL, "scorer": _mla_decode_scorer_kernel}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--workloads", nargs="+", default=["1x32768 h128 p1", "128x4096 h128 p1", "64x8192 h128 p64"])
    p.add_argument("--no-peer", action="store_true", help="leave FlashInfer MLA fa3 out")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for w in MLA_WORKLOADS:
        if w.kind != "decode" or not any(w.name.endswith(x) for x in args.workloads):
            continue
        rb = build_race_batch(w)
        ref = _oracle(rb)  # float32
        calls = {}
        for name in args.variants:
            gluon_host._mla_decode_colsplit_kernel = VARIANTS[name]
            call = attnserve_racer("triton", rb)
            err = _rel_err(output_rows(call(), rb), ref)
            calls[name] = call
            print(f"{w.name} {name}: rel err {err:.2e}", flush=True)
            rows.append({"workload": w.name, "variant": name, "rel_err": err, "us": []})
        if not args.no_peer:
            try:
                calls["flashinfer-mla-fa3"] = flashinfer_mla_racer(rb, "fa3")
                rows.append({"workload": w.name, "variant": "flashinfer-mla-fa3", "us": []})
            except Exception as e:  # noqa: BLE001 - the peer is optional here
                print(f"flashinfer-mla-fa3: {type(e).__name__}: {e}", flush=True)
        by_name = {r["variant"]: r for r in rows if r["workload"] == w.name}
        for _ in range(args.reps):
            for name, call in calls.items():
                if name in VARIANTS:
                    gluon_host._mla_decode_colsplit_kernel = VARIANTS[name]
                by_name[name]["us"].append(round(time_call(call, use_graph=True)[0], 2))
        gluon_host._mla_decode_colsplit_kernel = COLSPLIT_KERNEL
        for name, r in by_name.items():
            print(f"{w.name:24s} {name:20s} {min(r['us']):8.2f} us  {r['us']}", flush=True)
    if args.json:
        write_json(args.json, rows)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
