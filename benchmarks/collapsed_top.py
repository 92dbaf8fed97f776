"""Functions by their inclusive share of py-spy samples, from a collapsed-stack file (`py-spy record --format raw`).

    python3 benchmarks/collapsed_top.py engine.txt [N]

Inclusive: a sample counts once for every distinct function on its stack, so `Engine.step` near 100% and a
compile or a host sync under it shows its share of the engine's time directly.
"""

from __future__ import annotations

import collections
import re
import sys

_LINE = re.compile(r":\d+\)$")


def top(lines, n: int) -> list[tuple[str, int, float]]:
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        for frame in {_LINE.sub(")", f) for f in stack.split(";")}:  # a function once, whatever its lines
            inclusive[frame] += int(count)
    return [(frame, c, c / total) for frame, c in inclusive.most_common(n)] if total else []


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path) as f:
        rows = top(f, n)
    if not rows:
        print(f"{path}: no samples")
        return
    for frame, count, share in rows:
        print(f"{100 * share:6.1f}%  {count:7d}  {frame[:180]}")


if __name__ == "__main__":
    main()
