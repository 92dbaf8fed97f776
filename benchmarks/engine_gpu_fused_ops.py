"""The fused-ops GPU check in one call: CUDA tests, decode speed fused on/off, step profile, host cost.

Runs, each as its own process with its own time limit (about 6 minutes together on one H200):
1. the ops tests on CUDA: every fused kernel against its unfused composition in fp32 and
   bf16, and greedy outputs with fused ops on/off through the engine (tests/test_ops_*.py);
2. benchmarks/engine_gpu_decode.py, Llama-3-8B shape, 64 x 1024 in / 256 out, triton backend
   with CUDA graphs, fused ops on and off (and FlashInfer decode when it is installed);
3. benchmarks/engine_gpu_profile.py: per-step GPU time by kind and the host gap, eager and
   graphs, fused on and off;
4. benchmarks/engine_host_cost.py --device cuda: host time per step at 64 and 256 requests.

Each part writes its own JSON under benchmarks/results/; this script writes a summary
(exit codes, durations, the parts' headline figures) to benchmarks/results/engine_gpu_fused_ops.json.

    PYTHONPATH=src python3 benchmarks/engine_gpu_fused_ops.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def parts() -> list[tuple[str, list[str], int, Path | None]]:
    """(name, command, time limit in seconds, the JSON it writes)."""
    py = sys.executable
    configs = "triton-graphs,triton-graphs-unfused"
    if importlib.util.find_spec("flashinfer") is not None:
        configs += ",flashinfer-decode"
    decode_json = RESULTS / "engine_gpu_decode-fused-ops.json"
    profile_json = RESULTS / "engine_gpu_profile.json"
    host_json = RESULTS / "engine_host_cost-cuda.json"
    return [
        ("tests", [py, "-m", "pytest", "-q", "-rs", "tests/test_ops_kernels.py", "tests/test_ops_fused_model.py"],
         120, None),
        ("decode", [py, "benchmarks/engine_gpu_decode.py", "--configs", configs, "--out", str(decode_json)],
         210, decode_json),
        ("profile", [py, "benchmarks/engine_gpu_profile.py", "--steps", "8", "--out", str(profile_json)],
         180, profile_json),
        ("host_cost", [py, "benchmarks/engine_host_cost.py", "--device", "cuda", "--backends", "triton",
                       "--steps", "20", "--out", str(host_json)], 60, host_json),
    ]


def headline(name: str, report: dict) -> dict:
    """The figures a reader wants first from each part's JSON."""
    if name == "decode":
        return {r["label"]: {k: r.get(k) for k in ("decode_step_ms_median", "roofline_step_ms_mean",
                                                    "fraction_of_roofline", "output_tok_per_s", "pages_leaked")}
                | {"ratios": report.get("ratios")} for r in report.get("results", [])}
    if name == "profile":
        return {f"{r['mode']}-fused-{'on' if r['fused_ops'] else 'off'}": {
            k: r.get(k) for k in ("step_wall_ms_median", "kernel_busy_ms_per_step", "host_gap_ms_per_step",
                                  "per_step_ms_by_kind")} for r in report.get("results", [])}
    if name == "host_cost":
        return {f"{r['backend']}@{r['running_requests']}": r["median_ms"] for r in report.get("results", [])}
    return {}


def _text(captured) -> str:
    """A timed-out child's captured output (bytes even with text=True), as text."""
    if isinstance(captured, bytes):
        return captured.decode(errors="replace")
    return captured or ""


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    summary: dict = {"what": "fused ops on the GPU: tests, decode fused on/off, profile, host cost",
                     "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "parts": {}}
    for name, cmd, limit, out_json in parts():
        print(f"== {name}: {' '.join(cmd[1:])} (limit {limit} s)", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, timeout=limit, capture_output=True, text=True)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:  # its partial output still says how far it got
            code, output = "timeout", _text(exc.stdout) + _text(exc.stderr)
        secs = round(time.perf_counter() - t0, 1)
        print(output[-4000:], flush=True)
        entry = {"exit": code, "seconds": secs, "output_tail": output[-1500:]}
        if out_json is not None and out_json.exists() and out_json.stat().st_mtime > time.time() - secs - 5:
            report = json.loads(out_json.read_text())
            entry["json"] = str(out_json.relative_to(ROOT))
            entry["headline"] = headline(name, report)
            for key in ("gpu", "versions"):
                summary.setdefault(key, report.get(key))
        summary["parts"][name] = entry
        (RESULTS / "engine_gpu_fused_ops.json").write_text(json.dumps(summary, indent=2))  # after every part
    print(json.dumps({n: {k: p[k] for k in ("exit", "seconds")} | {"headline": p.get("headline")}
                      for n, p in summary["parts"].items()}, indent=2))


if __name__ == "__main__":
    main()
