"""Where an MLA race call's GPU time goes, kernel by kernel (torch.profiler's CUDA activity).

The race (`attnserve bench kernels`) times a whole call: for a split decode that is the split kernel and the LSE
merge, for FlashInfer its plan's kernels. This prints each kernel's device time per call, eagerly (no graph), so
a call's total can be read as its parts.

    PYTHONPATH=src python3 benchmarks/profile_mla_kernels.py --workloads "mla decode 1x32768" \\
        --backends triton flashinfer-mla-fa3 [--triton-options '{"max_kv_splits": 32}'] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict

import torch

from attnserve.bench.racers import build_race_batch, racers_for
from attnserve.bench.workloads import MLA_WORKLOADS, TINY_WORKLOADS, select


def kernel_times(fn, calls: int, cuda: bool) -> dict[str, float]:
    """Device microseconds per call, per kernel name, over `calls` eager calls after three warm-up calls (on the
    CPU: aten ops' own time, a smoke check of the script)."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync()
    per: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        t = (getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)) if cuda else \
            ev.self_cpu_time_total * ev.key.startswith("aten::")
        per[ev.key[:90]] += t / calls
    return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0}


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for name in ("triton", "flashinfer"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["mla decode"])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer-mla-fa3"])
    p.add_argument("--triton-options", default="{}", help="JSON: TritonBackend options")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny MLA workloads (TRITON_INTERPRET=1)")
    args = p.parse_args()
    rows = []
    device = "cpu" if args.tiny else "cuda"
    for i, w in enumerate(select(args.workloads, TINY_WORKLOADS if args.tiny else MLA_WORKLOADS)):
        rb = build_race_batch(w, device=device, seed=i)
        for name, factory in racers_for(rb, args.backends, json.loads(args.triton_options)).items():
            try:
                times = kernel_times(factory(), args.calls, device == "cuda")
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run here is reported, not fatal
                print(f"{w.name} {name}: {type(exc).__name__}: {exc}", flush=True)
                continue
            rows.append({"workload": w.name, "backend": name, "kernels_us": times, "total_us": round(sum(times.values()), 2)})
            print(f"{w.name} {name}: total {rows[-1]['total_us']} us", flush=True)
            for k, v in times.items():
                print(f"    {v:9.2f}  {k}", flush=True)
        rb.keep.clear()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "versions": versions(),
                       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
