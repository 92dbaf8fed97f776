"""Two server layouts against each other on the CPU: by default the engine in a process of its own against
the in-process server of an older checkout; with --candidate-flags, two flag sets of this checkout (e.g.
--api-workers 2 against one HTTP process).

Runs `attnserve bench serve --launch` on the embedded SmolLM2 at one closed-loop
concurrency, alternating the two servers (the machine may be shared: alternating
spreads its noise over both), and writes the points and the exact commands.

    python benchmarks/serve_cpu_processes.py --baseline-src /path/to/other/checkout/src \
        --out benchmarks/results/serve-cpu-processes.json
    python benchmarks/serve_cpu_processes.py --baseline-label api-workers-1 --candidate-label api-workers-2 \
        --candidate-flags "--api-workers 2" --out benchmarks/results/serve-cpu-api-workers.json

The baseline runs with PYTHONPATH set to --baseline-src (its bench client and its
server; default this checkout); the candidate is this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
FIELDS = ("output_tok_s", "request_throughput")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def bench_command(args, out: Path, extra_flags: str) -> list[str]:
    return [sys.executable, "-m", "attnserve", "bench", "serve", "--launch", f"{args.server_flags} {extra_flags}".strip(),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
            "--warmup-requests", "2", "--no-progress", "--json", str(out)]


def run_once(args, label: str, src: str, out: Path, extra_flags: str) -> dict:
    cmd = bench_command(args, out, extra_flags)
    env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    record = {"label": label, "pythonpath": src, "command": shlex.join(cmd), "returncode": proc.returncode}
    try:
        cfg = json.loads(out.read_text())["configs"][0]
        median = cfg["points"][0]["median"]
        record.update({k: median[k] for k in FIELDS})
        record.update({k: median[k]["p50"] for k in LATENCIES})
        record["itl_ms_p99"] = median["itl_ms"]["p99"]
        record.update(completed=median["completed"], failed=median["failed"], server_exit_code=cfg["server_exit_code"])
    except (OSError, ValueError, KeyError, IndexError) as exc:
        record["error"] = f"{exc!r}; stderr tail: {proc.stderr[-2000:]}"
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-src", default=SRC, help="src/ of the baseline's checkout (default: this one)")
    p.add_argument("--baseline-label", default="in-process")
    p.add_argument("--baseline-flags", default="", help="server flags of the baseline only")
    p.add_argument("--candidate-label", default="engine-process")
    p.add_argument("--candidate-flags", default="", help="server flags of the candidate only")
    p.add_argument("--title", default="attnserve serve on the CPU: engine in its own process vs in a thread of the "
                   "HTTP process")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--server-flags", default="--device cpu --max-running-requests 8")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        contestants = ((args.baseline_label, args.baseline_src, args.baseline_flags),
                       (args.candidate_label, SRC, args.candidate_flags))
        for i in range(args.repeats):
            for label, src, flags in contestants if i % 2 == 0 else contestants[::-1]:  # who goes first alternates
                record = run_once(args, label, src, Path(tmp) / f"{label}-{i}.json", flags)
                print(json.dumps(record), flush=True)
                runs.append(record)
    summary = {}
    base, cand = args.baseline_label, args.candidate_label
    for label in (base, cand):
        mine = [r for r in runs if r["label"] == label and "error" not in r]
        keys = (*FIELDS, *LATENCIES, "itl_ms_p99")
        summary[label] = {k: statistics.median(r[k] for r in mine) for k in keys} if mine else None
    if summary[base] and summary[cand]:
        summary[f"{cand}_vs_{base}_output_tok_s".replace("-", "_")] = round(
            summary[cand]["output_tok_s"] / summary[base]["output_tok_s"], 3)
    report = {"title": args.title,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "command": shlex.join([sys.executable, *sys.argv]), "settings": vars(args) | {"out": str(args.out)},
              "runs": runs, "median_of_runs": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
