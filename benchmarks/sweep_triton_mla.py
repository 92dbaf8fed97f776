"""Sweep the Triton MLA kernels' tiles (heads per program, key tile, warps, stages) on issue 12's workloads.

Each setting is checked against the float32 oracle before it is timed (a tile that computes
garbage fast must not win). Writes JSON with every (workload, setting) and the best per workload.

    PYTHONPATH=src python3 benchmarks/sweep_triton_mla.py --out sweep-mla.json [--tiny]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

from attnserve.attention.kernels.mla_decode import MLADecodeConfig
from attnserve.attention.kernels.mla_extend import MLAExtendConfig
from attnserve.attention.reference import reference_for_batch
from attnserve.bench.racers import attnserve_racer, build_race_batch
from attnserve.bench.timing import time_call
from attnserve.bench.workloads import MLA_WORKLOADS, TINY_WORKLOADS

DECODE_CONFIGS = [MLADecodeConfig(h, n, w, s) for h, n, w, s in (
    (16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (32, 16, 4, 2), (64, 32, 8, 2), (64, 16, 8, 2), (32, 64, 8, 1))]
EXTEND_CONFIGS = [MLAExtendConfig(m, n, w, s) for m, n, w, s in (
    (64, 32, 8, 2), (64, 64, 8, 1), (128, 32, 8, 2), (32, 32, 4, 2))]
TINY_CONFIGS = {"decode": [MLADecodeConfig(16, 16, 4, 1)], "extend": [MLAExtendConfig(16, 16, 4, 1)]}
# split waves (the default tiles): fewer splits write fewer float32 partials, more fill the GPU
WAVES = (0.5, 1.0, 4.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="sweep-mla.json")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run under TRITON_INTERPRET=1")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new settings after this long")
    args = p.parse_args()
    device = "cpu" if args.tiny else "cuda"
    workloads = [w for w in TINY_WORKLOADS if w.mla] if args.tiny else MLA_WORKLOADS
    started, rows = time.perf_counter(), []
    for i, w in enumerate(workloads):
        rb = build_race_batch(w, device=device, seed=i)
        ref = reference_for_batch(rb.q, rb.layer, rb.fb, compute_dtype=torch.float32)
        key = "mla_decode_config" if w.kind == "decode" else "mla_extend_config"
        configs = TINY_CONFIGS[w.kind] if args.tiny else (DECODE_CONFIGS if w.kind == "decode" else EXTEND_CONFIGS)
        settings = [({key: cfg}, {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}) for cfg in configs]
        if w.kind == "decode":
            settings += [({"split_waves": x}, {"split_waves": x}) for x in (WAVES[:1] if args.tiny else WAVES)]
        for options, described in settings:
            if time.perf_counter() - started > args.budget_s:
                print("budget spent; stopping", flush=True)
                break
            row = {"workload": w.name, **described}
            try:
                fn = attnserve_racer("triton", rb, **options)
                out = fn()
                row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                if device == "cuda" and row["rel_err"] < 1e-2:
                    us, _ = time_call(fn, use_graph=w.kind == "decode")
                    row["us"] = round(us, 1)
                    row["tflops"] = round(w.mla_flops() / us / 1e6, 1)
            except Exception as exc:  # noqa: BLE001 - a setting that cannot compile here is recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            rb.keep.clear()
            rows.append(row)
            print(json.dumps(row), flush=True)
    best = {}
    for r in rows:
        if "us" in r and (r["workload"] not in best or r["us"] < best[r["workload"]]["us"]):
            best[r["workload"]] = r
    result = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "torch": torch.__version__, "rows": rows, "best": best}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("best:", json.dumps(best, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
