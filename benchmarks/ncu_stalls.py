"""Where a kernel's warps wait, from the SASS table benchmarks/ncu_mla_decode.sh writes: the stall reasons over all
samples, then the instructions with the most samples (an mbarrier's try-wait loop shows as its retry branch, a
wgmma's wait as WARPGROUP.DEPBAR).

    python benchmarks/ncu_stalls.py sass-gluon_colsplit-128_4096_1.csv [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[1], rows[2:]  # rows[0] names the kernel
    col = {h: i for i, h in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def count(row, i):
        return int(row[i] or 0)

    total = sum(count(r, samples) for r in data)
    by_reason = collections.Counter({h[6:]: sum(count(r, col[h]) for r in data) for h in reasons})
    print(f"{len(data)} instructions, {total} samples")
    for reason, n in by_reason.most_common(10):
        print(f"  {reason:18s} {n:7d} {100 * n / max(total, 1):5.1f}%")
    for r in sorted(data, key=lambda r: -count(r, samples))[:args.top]:
        main_reason = max(reasons, key=lambda h: count(r, col[h]))[6:]
        print(f"{r[0][-5:]} {count(r, samples):6d} executed {r[col['Instructions Executed']]:>7s} {main_reason:12s} "
              f"{r[1].strip()[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
