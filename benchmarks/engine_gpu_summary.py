"""One line per configuration of an engine_gpu_decode.py result: backends, decode step against its roofline."""

import json
import sys
from pathlib import Path


def main(path: str) -> None:
    report = json.loads(Path(path).read_text())
    for r in report["results"]:
        print(f"{r['label']:<20} {r['workload']:<14} prefill {r['prefill_backend']:<11} decode {r['decode_backend']:<11}"
              f" step {r['decode_step_ms_median']:>7.3f} ms  roofline {r['roofline_step_ms_mean']:>6.3f} ms"
              f" ({r['fraction_of_roofline']:.0%})  {r['output_tok_per_s']:>8.1f} tok/s  prefill {r['prefill_s']} s"
              f"  pages leaked {r['pages_leaked']}  graphed {r['graphed_steps']}")
    print("ratios", json.dumps(report["ratios"]))
    if report["errors"]:
        print("errors", json.dumps(report["errors"])[:800])


if __name__ == "__main__":
    main(sys.argv[1])
