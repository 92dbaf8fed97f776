"""The server with its engine in a process of its own against the in-process server, on the CPU.

Runs `attnserve bench serve --launch` on the embedded SmolLM2 at one closed-loop
concurrency, alternating the two servers (the machine may be shared: alternating
spreads its noise over both), and writes the points and the exact commands.

    python benchmarks/serve_cpu_processes.py --baseline-src /path/to/other/checkout/src \
        --out benchmarks/results/serve-cpu-processes.json

The baseline runs with PYTHONPATH set to --baseline-src (its bench client and its
server); the candidate is this checkout.
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


def bench_command(args, out: Path) -> list[str]:
    return [sys.executable, "-m", "attnserve", "bench", "serve", "--launch", args.server_flags,
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
            "--warmup-requests", "2", "--no-progress", "--json", str(out)]


def run_once(args, label: str, src: str, out: Path) -> dict:
    cmd = bench_command(args, out)
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
    p.add_argument("--baseline-src", required=True, help="src/ of the in-process server's checkout")
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
        for i in range(args.repeats):
            for label, src in (("in-process", args.baseline_src), ("engine-process", SRC)):
                record = run_once(args, label, src, Path(tmp) / f"{label}-{i}.json")
                print(json.dumps(record), flush=True)
                runs.append(record)
    summary = {}
    for label in ("in-process", "engine-process"):
        mine = [r for r in runs if r["label"] == label and "error" not in r]
        keys = (*FIELDS, *LATENCIES, "itl_ms_p99")
        summary[label] = {k: statistics.median(r[k] for r in mine) for k in keys} if mine else None
    if summary["in-process"] and summary["engine-process"]:
        summary["engine_process_vs_in_process_output_tok_s"] = round(
            summary["engine-process"]["output_tok_s"] / summary["in-process"]["output_tok_s"], 3)
    report = {"title": "attnserve serve on the CPU: engine in its own process vs in a thread of the HTTP process",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "command": shlex.join([sys.executable, *sys.argv]), "settings": vars(args) | {"out": str(args.out)},
              "runs": runs, "median_of_runs": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
