"""The mixed-step token budget on the H200: ITL p99 against throughput, then a Poisson sweep of the default.

One command, about 7.5 minutes on an H200 with the Llama-3-8B shape and random weights:

1. the offline engine (engine_gpu_decode.py) on the same workload and settings, once per budget: its
   output tok/s and full-batch decode step are what the server's numbers are divided by;
2. `attnserve bench serve` launching the server with the default budget: closed loop at c=64
   (>= 200 requests), then open-loop Poisson rates with goodput under the issue's SLO;
3. the same server with every other budget (`--max-num-batched-tokens 0` is the budget off: a whole
   --chunked-prefill-size chunk joins the running decodes) at c=64.

Every server gets as many warm-up requests as the concurrency before its first point, so no JIT compile
or first-use cost lands in a measured point. Every phase has a deadline; the merged record
(serve-budget.json + .md, budget.png, and bench serve's own serve-default.png with the Poisson curves)
is written whatever ran, saying what did not.

    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py OUT_DIR            # the H200 run
    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py OUT_DIR --quick    # CPU dry run, embedded model
    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py OUT_DIR --cpu      # the same sweep on a CPU (~25 min)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLO = {"ttft": 1000, "tpot": 50}  # ms: the Poisson target (TTFT p99 <= 1 s, ITL p99 <= 50 ms)

# budgets: the default configuration's first; 0 is the budget off
GPU = {
    "budgets": "512,256,1024,0", "concurrency": 64, "num_prompts": 200, "rates": "4,8,12,16", "rate_prompts": 120,
    "input_len": 1024, "output_len": 256, "chunk": 8192, "deadline_s": 470, "offline_s": 150,
    "server": "--random-weights --attention-backend triton --disable-radix-cache --max-running-requests 64",
    "offline": "--configs triton-graphs --preset llama-3-8b",
}
QUICK = {
    "budgets": "32,0", "concurrency": 4, "num_prompts": 8, "rates": "4,inf", "rate_prompts": 6,
    "input_len": 48, "output_len": 6, "chunk": 64, "deadline_s": 1200, "offline_s": 500,
    "server": "--disable-radix-cache --max-running-requests 4",
    "offline": "--configs torch-native --preset smollm2-135m --device cpu",
}
CPU = {  # the embedded model on a small CPU: prompts long enough that a whole chunk stalls the decodes
    "budgets": "512,128,256,1024,0", "concurrency": 8, "num_prompts": 32, "rates": "0.5,1,2", "rate_prompts": 24,
    "input_len": 512, "output_len": 64, "chunk": 2048, "deadline_s": 1800, "offline_s": 400,
    "server": "--device cpu --disable-radix-cache --max-running-requests 8",
    "offline": "--configs torch-native --preset smollm2-135m --device cpu",
}


class Clock:
    def __init__(self, deadline_s: float):
        self.end = time.monotonic() + deadline_s

    def left(self) -> float:
        return self.end - time.monotonic()


def run(cmd: list[str], log: Path, timeout: float, what: str, notes: list[str]) -> bool:
    """Run one phase, its output in `log`; False (with a note) when it failed or ran out of time."""
    if timeout < 20:
        notes.append(f"{what}: not run, {timeout:.0f} s left")
        return False
    print(f"[{what}] {shlex.join(cmd)}  (timeout {timeout:.0f} s, log {log})", flush=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM: bench serve stops the server it launched and writes the points it measured
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            notes.append(f"{what}: stopped after {timeout:.0f} s (what it measured is kept)")
            return False
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        notes.append(f"{what}: exit {rc}: " + " / ".join(tail)[:400])
    return rc == 0


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _budget_label(budget: int) -> str:
    return "off" if budget <= 0 else str(budget)


def _c_point(cfg: dict, concurrency: int) -> dict | None:
    for p in cfg.get("points", []):
        if p["load"] == "concurrency" and p["value"] == concurrency and p["median"].get("completed"):
            return p["median"]
    return None


def _num(x) -> float | None:
    """A measured number, or None (absent, or NaN: e.g. no full-batch decode step to take the median of)."""
    return None if x is None or math.isnan(x) else x


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def budget_rows(
    budgets: list[int], served: dict[int, dict], offline: dict | None, concurrency: int
) -> list[dict]:
    """One row per budget: the server at c=`concurrency` beside the offline engine with the same settings."""
    off = {r.get("max_num_batched_tokens"): r for r in (offline or {}).get("results", [])}
    rows = []
    for b in budgets:
        m = _c_point(served.get(b) or {}, concurrency)
        o = off.get(b)
        row = {"max_num_batched_tokens": _budget_label(b)}
        if m:
            row.update(
                out_tok_s=m["output_tok_s"], tpot_p50_ms=m["tpot_ms"]["p50"], itl_p50_ms=m["itl_ms"]["p50"],
                itl_p99_ms=m["itl_ms"]["p99"], ttft_p50_ms=m["ttft_ms"]["p50"], ttft_p99_ms=m["ttft_ms"]["p99"],
                completed=m["completed"],
            )
        if o:
            row.update(
                offline_out_tok_s=_num(o["output_tok_per_s"]), offline_step_ms=_num(o["decode_step_ms_median"])
            )
        row["out_vs_offline"] = _ratio(row.get("out_tok_s"), row.get("offline_out_tok_s"))
        row["tpot_p50_vs_offline_step"] = _ratio(row.get("tpot_p50_ms"), row.get("offline_step_ms"))
        row["itl_p99_over_p50"] = _ratio(row.get("itl_p99_ms"), row.get("itl_p50_ms"))
        rows.append(row)
    return rows


def poisson_rows(default_cfg: dict | None) -> tuple[list[dict], float | None]:
    """Per request rate of the default configuration, and the highest rate within the SLO."""
    rows, best = [], None
    for p in (default_cfg or {}).get("points", []):
        if p["load"] != "rate" or not p["median"].get("completed"):
            continue
        m = p["median"]
        row = {
            "rate": p["value"], "completed": m["completed"], "out_tok_s": m["output_tok_s"],
            "ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
            "tpot_p50_ms": m["tpot_ms"]["p50"], "itl_p50_ms": m["itl_ms"]["p50"],
            "itl_p99_ms": m["itl_ms"]["p99"],
            "goodput_req_s": (m.get("goodput") or {}).get("request_goodput"),
        }
        row["within_slo"] = (row["ttft_p99_ms"] is not None and row["ttft_p99_ms"] <= SLO["ttft"]
                             and row["itl_p99_ms"] is not None and row["itl_p99_ms"] <= SLO["tpot"])
        if row["within_slo"] and p["value"] != "inf" and (best is None or p["value"] > best):
            best = p["value"]
        rows.append(row)
    return rows, best


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(nothing measured)"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    out += ["| " + " | ".join("-" if r.get(k) is None else str(r[k]) for k in keys) + " |" for r in rows]
    return out


def plot_budgets(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = list(range(len(rows)))
    names = [r["max_num_batched_tokens"] for r in rows]
    for key, style, label in (("out_tok_s", "o-", "server"), ("offline_out_tok_s", "s--", "offline engine")):
        left.plot(x, [r.get(key, float("nan")) or float("nan") for r in rows], style, label=label)
    left.set_ylabel("output tok/s")
    lines = (("itl_p50_ms", "o-"), ("itl_p99_ms", "s--"), ("tpot_p50_ms", "^:"), ("offline_step_ms", "x-."))
    for key, style in lines:
        right.plot(x, [r.get(key, float("nan")) or float("nan") for r in rows], style, label=key)
    right.set_ylabel("ms")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xticks(x, names)
        ax.set_xlabel("--max-num-batched-tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("step token budget: throughput and inter-token latency (closed loop)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for every result and log")
    ap.add_argument("--quick", action="store_true", help="tiny CPU dry run on the embedded model")
    ap.add_argument("--cpu", action="store_true", help="the sweep on a CPU with the embedded model")
    ap.add_argument("--budgets", help="--max-num-batched-tokens values, the default configuration's first")
    ap.add_argument("--rates", help="Poisson request rates of the default configuration")
    ap.add_argument("--server-flags", help="flags of every launched server besides model, chunk and budget "
                    "(the offline engine runs triton-graphs: keep the backends alike)")
    ap.add_argument("--deadline-s", type=float, help="seconds for the whole run")
    args = ap.parse_args()
    p = dict(QUICK if args.quick else CPU if args.cpu else GPU)
    for key in ("budgets", "rates", "deadline_s"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    if args.server_flags is not None:
        p["server"] = args.server_flags
    budgets = [int(b) for b in p["budgets"].split(",")]
    default = budgets[0]
    out, logs = args.out, args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    clock, notes, py = Clock(p["deadline_s"]), [], sys.executable
    c, n_in, n_out = p["concurrency"], p["input_len"], p["output_len"]

    model_flags, tokenizer = [], []
    if not (args.quick or args.cpu):  # config + tokenizer of the Llama-3-8B shape; the servers draw random weights on the GPU
        model_dir = out / "llama3-8b-config"
        run([py, "benchmarks/serve_h200_model.py", str(model_dir), "--no-weights"], logs / "model.log",
            min(60, clock.left()), "model directory", notes)
        model_flags, tokenizer = ["--model", str(model_dir)], ["--tokenizer", str(model_dir)]
    engine_flags = f"{shlex.join(model_flags)} {p['server']} --chunked-prefill-size {p['chunk']}".strip()

    offline_json = out / "offline.json"
    run([py, "benchmarks/engine_gpu_decode.py", *shlex.split(p["offline"]), "--workloads", f"{c}x{n_in}x{n_out}",
         "--chunked-prefill-size", str(p["chunk"]), "--max-num-batched-tokens", p["budgets"],
         "--out", str(offline_json)],
        logs / "offline.log", min(p["offline_s"], clock.left() - 200), "offline engine", notes)

    common = ["-m", "attnserve", "bench", "serve", "--dataset-name", "random", "--input-len", str(n_in),
              "--output-len", str(n_out), *tokenizer, "--warmup-requests", str(c), "--no-progress",
              "--server-log-dir", str(logs), "--max-point-seconds", "90"]
    default_json = out / "serve-default.json"
    rates = p["rates"].split(",")
    prompts = ",".join([str(p["num_prompts"])] + [str(p["rate_prompts"])] * len(rates))
    run([py, *common, "--launch", engine_flags,
         "--compare", f"b{_budget_label(default)}=--max-num-batched-tokens {default}",
         "--concurrency", str(c), "--request-rate", p["rates"], "--num-prompts", prompts,
         "--goodput", *(f"{k}:{v}" for k, v in SLO.items()), "--title", f"default budget {default}",
         "--json", str(default_json)], logs / "serve-default.log", clock.left() - 150, "default server", notes)

    others_json = out / "serve-budgets.json"
    compare = [f"b{_budget_label(b)}=--max-num-batched-tokens {b}" for b in budgets[1:]]
    if compare:
        run([py, *common, "--launch", engine_flags, "--compare", *compare, "--concurrency", str(c),
             "--num-prompts", str(p["num_prompts"]), "--title", "other budgets", "--json", str(others_json)],
            logs / "serve-budgets.log", clock.left() - 35, "other budgets", notes)

    default_rep, others_rep, offline = _load(default_json), _load(others_json), _load(offline_json)
    served = {}
    if default_rep and default_rep.get("configs"):
        served[default] = default_rep["configs"][0]
    for b, cfg in zip(budgets[1:], (others_rep or {}).get("configs", [])):
        served[b] = cfg
    rows = budget_rows(sorted(budgets, key=lambda b: (b <= 0, b)), served, offline, c)
    rate_rows, best = poisson_rows(served.get(default))
    record = {
        "what": f"closed loop c={c} and Poisson rates, random {n_in} in / {n_out} out; "
                f"server flags: {engine_flags}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": (default_rep or others_rep or {}).get("gpu"),
        "versions": (offline or {}).get("versions"),
        "command": shlex.join(["python3", "benchmarks/serve_h200_budget.py", *sys.argv[1:]]),
        "default_budget": default,
        "slo_ms": SLO,
        "budget_sweep": rows,
        "poisson": rate_rows,
        "highest_rate_within_slo": best,
        "notes": notes,
        "inputs": {"offline": str(offline_json), "default": str(default_json),
                   "other_budgets": str(others_json)},
    }
    (out / "serve-budget.json").write_text(json.dumps(record, indent=1) + "\n")
    poisson_head = (f"## Poisson sweep, budget {_budget_label(default)} (SLO: TTFT p99 <= {SLO['ttft']} ms, "
                    f"ITL p99 <= {SLO['tpot']} ms; goodput counts TPOT <= {SLO['tpot']} ms)")
    md = [f"# Step token budget: {record['what']}", "", f"- {record['date']}, {record['gpu']}",
          f"- command: `{record['command']}`", *(f"- note: {n}" for n in notes), "",
          "## Budget sweep (closed loop)", "", *_table(rows), "", poisson_head, "", *_table(rate_rows), "",
          f"Highest rate within the SLO: {best if best is not None else 'none measured'}"]
    (out / "serve-budget.md").write_text("\n".join(md) + "\n")
    plot_budgets(rows, out / "budget.png")
    print("\n".join(md), flush=True)
    return 0 if rows and any("out_tok_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
