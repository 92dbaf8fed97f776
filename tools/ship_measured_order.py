"""Write the fallback order a committed kernel race measured into the package data.

    python tools/ship_measured_order.py benchmarks/results/kernels-h200.json \
        benchmarks/results/kernels-mla-h200.json

Updates src/attnserve/choice/measured_order.json (keyed by GPU model, e.g. h200, then attention
type, MHA or MLA), which selection reads in any install, source checkout or wheel. Each file
replaces the entries of the attention types it raced and leaves the others.
"""

import json
import sys
from pathlib import Path

from attnserve.choice.measured import DATA_FILE, gpu_key, order_entry

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def main(paths: list[str]) -> None:
    target = ROOT / "src" / "attnserve" / "choice" / DATA_FILE
    shipped = json.loads(target.read_text()) if target.is_file() else {}
    for path in paths:
        result = json.loads(Path(path).read_text())
        source = Path(path).resolve().relative_to(RESULTS).as_posix()  # named within benchmarks/results
        entries = order_entry(result, source)
        if not entries:
            sys.exit(f"{path}: no records of a backend attnserve implements; nothing to ship")
        per_gpu = shipped.setdefault(gpu_key(result["gpu"]), {})
        if not all(k in ("MHA", "MLA") for k in per_gpu):  # an entry of the old one-order-per-GPU format
            per_gpu.clear()
        per_gpu.update(entries)
    target.write_text(json.dumps(shipped, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target.relative_to(ROOT)}: " + ", ".join(f"{gpu} {'+'.join(sorted(v))}" for gpu, v in sorted(shipped.items())))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
