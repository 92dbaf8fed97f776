"""Triton's time per workload in a new race against a committed one: did a change slow a kernel down?

    python3 benchmarks/compare_kernel_runs.py benchmarks/results/kernels-h200.json new.json [--out cmp.json]

Absolute times move between leases of the same GPU (clocks, neighbours), so the verdict uses the
ratio to FlashInfer measured in the same run where both runs have it, and raw times otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys


def triton_rows(path: str) -> dict[str, dict]:
    with open(path) as f:
        return {r["workload"]: r for r in json.load(f)["records"] if r.get("backend") == "triton" and "us" in r}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    before, after = triton_rows(args.before), triton_rows(args.after)
    rows = []
    for name in before:
        if name not in after:
            continue
        b, a = before[name], after[name]
        row = {"workload": name, "us_before": b["us"], "us_after": a["us"], "time_ratio": round(a["us"] / b["us"], 3)}
        if "vs_flashinfer" in b and "vs_flashinfer" in a:
            row["vs_flashinfer_before"], row["vs_flashinfer_after"] = b["vs_flashinfer"], a["vs_flashinfer"]
        rows.append(row)
        print(f"{name:<24} {b['us']:>9.1f} us -> {a['us']:>9.1f} us  (x{row['time_ratio']:.3f})"
              + (f"   vs FlashInfer {row['vs_flashinfer_before']:.2f} -> {row['vs_flashinfer_after']:.2f}"
                 if "vs_flashinfer_after" in row else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"before": args.before, "after": args.after, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
