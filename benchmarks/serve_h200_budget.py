"""The mixed-step token budget on the H200: throughput against the stalls streams see, in steps that each fit a call.

Each step ends well inside 4-5 minutes on an H200 (Llama-3-8B shape, random weights, triton backend,
1024 in / 256 out, 64 streams, chunks of 8192), keeps a deadline of its own (`--deadline-s`), writes its own
JSON after every unit of work (so a step cut short keeps what it measured), and then re-merges everything
under OUT_DIR into serve-budget.{json,md} and budget.png:

- `offline`  the engine in this process, ONE model load and ONE engine for every budget: the step budget is
             swapped on the idle engine (`Engine.set_step_budget`), so only the scheduler changes. Per budget a
             bounded number of closed waves (all prompts at once): output tok/s, the full-batch decode step,
             TTFT, the inter-token latency every stream saw (p50 / p99 / max: the stall), and every mixed step's
             decodes, prompt tokens and wall time; then the least-squares cost of a mixed step against a decode
             step, wall = a + b * prompt tokens + c * decodes -> offline.json;
- `served`   `attnserve bench serve` launching the server at the default budget and with the budget off at
             closed-loop c=64 (200 requests, 64 warm-up requests per server), each row beside the offline
             engine's with the same budget (offline.json, when the offline step ran in this OUT_DIR) -> served.json;
- `poisson`  the default budget at Poisson rates with goodput under the SLO -> poisson.json;
- `report`   only the merge (no GPU needed: gather the steps' JSONs in one folder first, or pass
             --offline-json); `all` runs the three steps in order (the CPU sweep).

    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py offline OUT_DIR            # the H200 run, ~2.5 min
    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py served OUT_DIR             # ~3 min
    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py poisson OUT_DIR            # ~3 min
    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py all OUT_DIR --quick        # CPU dry run of every step
    PYTHONPATH=src python3 benchmarks/serve_h200_budget.py all OUT_DIR --cpu          # the sweep on a CPU (~25 min)

Budgets are --max-num-batched-tokens values: N (a fixed cap), off (or 0), auto, auto:S, or default (the
flag unset: the device's default, auto on a GPU and 512 on a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLO = {"ttft": 1000, "tpot": 50}  # ms: the Poisson target (TTFT p99 <= 1 s, ITL p99 <= 50 ms)
STEPS = ("offline", "served", "poisson", "c1", "report", "all")

GPU = {
    "offline_budgets": "auto,off,512,2048,1024,256,auto:32768,auto:131072", "waves": 2,
    "served_budgets": "default,off", "concurrency": 64, "num_prompts": 200, "rates": "4,8,12,16,20,24,32",
    "rate_prompts": 120, "c1_prompts": 8, "input_len": 1024, "output_len": 256, "chunk": 8192, "deadline_s": 270,
    "preset": "llama-3-8b", "device": "cuda", "backend": "triton",
    # two API workers: one HTTP process is measured elsewhere; here the engine's schedule is what differs
    "server": "--random-weights --attention-backend triton --disable-radix-cache --max-running-requests 64 "
              "--api-workers 2",
}
QUICK = {
    "offline_budgets": "auto:96,32,off", "waves": 1,
    "served_budgets": "default,off", "concurrency": 4, "num_prompts": 8, "rates": "4,inf", "rate_prompts": 6, "c1_prompts": 2,
    "input_len": 48, "output_len": 6, "chunk": 64, "deadline_s": 600,
    "preset": "smollm2-135m", "device": "cpu", "backend": "torch_native",
    "server": "--device cpu --disable-radix-cache --max-running-requests 4",
}
CPU = {  # the embedded model on a small CPU: prompts long enough that a whole chunk stalls the decodes
    "offline_budgets": "default,128,256,1024,off,auto", "waves": 1,
    "served_budgets": "default,128,256,1024,off", "concurrency": 8, "num_prompts": 32, "rates": "0.5,1,2",
    "rate_prompts": 24, "c1_prompts": 4, "input_len": 512, "output_len": 64, "chunk": 2048, "deadline_s": 1800,
    "preset": "smollm2-135m", "device": "cpu", "backend": "torch_native",
    "server": "--device cpu --disable-radix-cache --max-running-requests 8",
}


class Clock:
    def __init__(self, deadline_s: float):
        self.end = time.monotonic() + deadline_s

    def left(self) -> float:
        return self.end - time.monotonic()


def budget_label(value: str) -> str:
    """A --max-num-batched-tokens value as the tables name it: default, off, auto, auto:S or N."""
    v = str(value).strip().lower()
    if v in ("default", ""):
        return "default"
    if v == "off" or (v.lstrip("-").isdigit() and int(v) <= 0):
        return "off"
    return v


def budget_flag(label: str) -> str:
    """The serve flags that give a budget label ('' for the default)."""
    if label == "default":
        return ""
    return f"--max-num-batched-tokens {0 if label == 'off' else label}"


def pieces_max_tokens(budgets: str, max_running: int, device: str) -> int:
    """The largest step the offline engine captures in pieces: the sweep's largest fixed budget, "default"
    counted as what it resolves to with pieces on (a sweep of "512,default" once captured pieces only up to 512,
    so the default's larger mixed steps ran eagerly); 2048 where the sweep has no fixed budget."""
    from attnserve.engine.schedule_policy import resolve_step_budget

    fixed = [resolve_step_budget(engine_value(budget_label(b)), max_running, device, piecewise=True)
             for b in budgets.split(",") if b.strip()]
    return max([b.tokens for b in fixed if b.kind == "fixed"] or [2048])


def engine_value(label: str):
    """A budget label as Engine.set_step_budget takes it."""
    return None if label == "default" else 0 if label == "off" else label


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def _versions() -> dict:
    out = {}
    try:
        import torch

        out.update(torch=torch.__version__, cuda=torch.version.cuda)
    except ImportError:
        pass
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        out["source_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                              text=True, timeout=10).stdout.strip() or None
    except OSError:
        pass
    return out


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    import platform

    return f"none ({platform.machine()} CPU)"


# ---- offline: one model, one engine, the budget swapped between waves ------------------------------------------
def _fit(rows: list[tuple[float, ...]]) -> list[float] | None:
    """Least squares y = a + b * x1 + c * x2 ... over rows (x1, x2, ..., y); None when underdetermined."""
    import numpy as np

    if len(rows) < len(rows[0]) + 1:
        return None
    a = np.array([[1.0, *r[:-1]] for r in rows])
    y = np.array([r[-1] for r in rows])
    if np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return [float(c) for c in coef]


def step_costs(steps: list[dict]) -> dict:
    """The cost model of a step from every step the waves ran: decode wall = a_d + c_d * decodes; mixed wall =
    a + b * prompt tokens + c * decodes; a - a_d is a mixed step's fixed cost beyond a decode step."""
    out = {}
    dec = [(s["decodes"], s["wall_ms"]) for s in steps if s["mode"] == "decode"]
    mix = [(s["prompt_tokens"], s["decodes"], s["wall_ms"]) for s in steps if s["mode"] == "mixed"]
    fd = _fit(dec) if dec else None
    if fd:
        out["decode"] = {"fixed_ms": round(fd[0], 3), "per_decode_ms": round(fd[1], 4), "steps": len(dec)}
    fm = _fit(mix) if mix else None
    if fm:
        out["mixed"] = {"fixed_ms": round(fm[0], 3), "per_prompt_token_us": round(fm[1] * 1e3, 3),
                        "per_decode_ms": round(fm[2], 4), "steps": len(mix)}
        if fd:
            out["mixed_fixed_over_decode_ms"] = round(fm[0] - fd[0], 3)
    return out


def run_wave(engine, prompts: list[list[int]], output_len: int, steps: list[dict]) -> dict:
    """All prompts at once, run to the end; what the streams saw."""
    from attnserve.engine.sampling_params import SamplingParams

    st = type(engine.step_times)()
    engine.step_times = st
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    total = time.perf_counter() - start
    c = len(prompts)
    full = [t for t, b in zip(st.decode, st.decode_batch) if b == c]
    itl = [x for r in reqs for x in r.inter_token_latencies_s]
    ttft = [r.ttft_s for r in reqs]
    mixed = [s for s in steps if s["mode"] == "mixed"]
    return {
        "total_s": round(total, 3), "output_tok_s": round(c * output_len / total, 1),
        "decode_step_ms_median": _ms(statistics.median(full)) if full else None,
        "itl_ms": {"p50": _ms(_pct(itl, 0.5)), "p99": _ms(_pct(itl, 0.99)), "max": _ms(max(itl, default=None))},
        "ttft_ms": {"p50": _ms(_pct(ttft, 0.5)), "p99": _ms(_pct(ttft, 0.99))},
        "steps": {"decode": len(st.decode), "mixed": len(st.mixed), "extend": len(st.extend)},
        "mixed_step_ms_median": round(statistics.median(s["wall_ms"] for s in mixed), 3) if mixed else None,
        "mixed_prompt_tokens_median": statistics.median(s["prompt_tokens"] for s in mixed) if mixed else None,
        "pages_leaked": engine.pages_leaked(),
    }


def _record_steps(engine, steps: list[dict]) -> None:
    """Every completed step's mode, decodes, prompt tokens and wall time (the engine's own StepTimes entry)."""
    complete = engine._complete

    def recorded(step):
        out = complete(step)
        b = step.batch
        times = getattr(engine.step_times, b.mode.value)
        if times:
            steps.append({"mode": b.mode.value, "decodes": b.num_decodes, "prompt_tokens": b.num_tokens - b.num_decodes,
                          "wall_ms": round(times[-1] * 1e3, 3)})
        return out

    engine._complete = recorded


def _watch_syncs(engine, counts: dict, messages: list[str]):
    """Count synchronizing CUDA calls (torch's sync debug mode) made while launching each step, by the step's
    mode: launching never needs one (the one wait per step is for the previous step's tokens, outside the
    launch). Returns the function that stops watching."""
    import warnings

    import torch

    launch = engine._launch
    if not torch.cuda.is_available():
        return lambda: None

    def watched(in_flight):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step = launch(in_flight)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        msgs = [str(w.message).splitlines()[0] for w in caught if "synchronizing" in str(w.message).lower()]
        if step is not None:
            mode = step.batch.mode.value
            counts[mode] = counts.get(mode, 0) + len(msgs)
            counts[f"{mode}_steps"] = counts.get(f"{mode}_steps", 0) + 1
            messages.extend(m for m in msgs if m not in messages and len(messages) < 5)
        return step

    engine._launch = watched

    def stop():
        engine._launch = launch

    return stop


def _header(p: dict, notes: list[str], what: str) -> dict:
    """What every step's record starts with: what ran, when, where, with which versions and command."""
    return {"what": what, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": _device_name(p["device"]), "versions": _versions(),
            "command": shlex.join(["python3", "benchmarks/serve_h200_budget.py", *sys.argv[1:]]), "notes": notes}


def offline_engine(p: dict):
    """(the engine, the vocabulary size): random weights, the servers' settings (max running = concurrency,
    graphs to that batch, radix cache off), the device's default step budget."""
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine
    from attnserve.models.loader import load_model

    c, n_in, n_out = p["concurrency"], p["input_len"], p["output_len"]
    loaded = load_model(p["preset"], dtype="bf16" if p["device"] == "cuda" else "fp32", device=p["device"],
                        random_weights=True)
    cfg = EngineConfig(device=p["device"], attention_backend=p["backend"], max_running_requests=c,
                       cuda_graph_max_bs=c,
                       max_total_tokens=p.get("pool_tokens") or c * (n_in + n_out) + 2 * p["chunk"] + 1024,
                       chunked_prefill_size=p["chunk"], disable_radix_cache=True,
                       disable_piecewise_cuda_graph=bool(p.get("eager_mixed")),
                       # every fixed budget of the sweep fits the pieces (the engine is built once for all)
                       piecewise_cuda_graph_max_tokens=pieces_max_tokens(p["offline_budgets"], c, p["device"]))
    return Engine(cfg, loaded=loaded), loaded.config.vocab_size


def step_offline(p: dict, out: Path, clock: Clock, notes: list[str], budgets: list[str]) -> dict:
    import torch

    c, n_in, n_out = p["concurrency"], p["input_len"], p["output_len"]
    path = out / "offline.json"
    record = {
        **_header(p, notes, f"the offline engine, {p['preset']} random weights, {p['backend']}, {c} prompts at once "
                            f"x {n_in} in / {n_out} out, chunks of {p['chunk']}, radix cache off, {p['waves']} "
                            "wave(s) per budget; one model and one engine, the step budget swapped between budgets"),
        "results": [],
    }
    t0 = time.perf_counter()
    engine, vocab = offline_engine(p)
    record["startup_s"] = round(time.perf_counter() - t0, 1)
    record["default_budget"] = engine.step_budget.label
    record["startup_log"] = [line for line in engine.parts.startup_lines if line.startswith(("step budget", "attention",
                                                                                             "CUDA graphs"))]
    g = torch.Generator().manual_seed(0)

    def prompts():
        return [torch.randint(0, vocab, (n_in,), generator=g).tolist() for _ in range(c)]

    # warm-up, untimed: every kernel the waves run compiles here (prefill chunks, mixed steps at a small and a large
    # prompt share, decode at the full batch)
    t0 = time.perf_counter()
    numeric = [int(b) for b in budgets if b.strip().isdigit()]
    syncs, sync_messages = {}, []
    for i, warm in enumerate(("off", str(min(numeric)) if numeric else (budgets[0] if budgets else "off"))):
        engine.set_step_budget(engine_value(budget_label(warm)))
        # the second warm wave runs with every launch watched for host syncs (compiles happened in the first)
        stop = _watch_syncs(engine, syncs, sync_messages) if i == 1 else (lambda: None)
        try:
            run_wave(engine, prompts(), min(n_out, 8), [])
        finally:
            stop()
    record["warmup_s"] = round(time.perf_counter() - t0, 1)
    record["sync_calls_launching_warmup_wave"] = {"by_mode": syncs, "messages": sync_messages}
    _write(path, record)
    steps: list[dict] = []
    _record_steps(engine, steps)
    for b in budgets:
        label = budget_label(b)
        per_wave_guess = max((r["wave_s_max"] for r in record["results"]), default=0.0)
        if clock.left() < max(20.0, 1.5 * per_wave_guess * p["waves"]):
            notes.append(f"offline budget {label}: not run, {clock.left():.0f} s left")
            continue
        resolved = engine.set_step_budget(engine_value(label))
        first = len(steps)
        waves = []
        for _ in range(p["waves"]):
            waves.append(run_wave(engine, prompts(), n_out, steps))
            if clock.left() < 10:
                notes.append(f"offline budget {label}: {len(waves)} of {p['waves']} waves (deadline)")
                break
        med = {k: statistics.median(w[k] for w in waves) for k in ("output_tok_s", "total_s")}
        row = {
            "budget": label, "resolved": resolved.label, "waves": len(waves),
            "output_tok_s": round(med["output_tok_s"], 1), "wave_s_max": max(w["total_s"] for w in waves),
            "decode_step_ms_median": waves[-1]["decode_step_ms_median"],
            "itl_ms": waves[-1]["itl_ms"], "ttft_ms": waves[-1]["ttft_ms"],
            "itl_p99_ms_per_wave": [w["itl_ms"]["p99"] for w in waves],
            "output_tok_s_per_wave": [w["output_tok_s"] for w in waves],
            "steps": waves[-1]["steps"], "mixed_step_ms_median": waves[-1]["mixed_step_ms_median"],
            "mixed_prompt_tokens_median": waves[-1]["mixed_prompt_tokens_median"],
            "cost_model": step_costs(steps[first:]),
            "pages_leaked": max(w["pages_leaked"] for w in waves),
        }
        record["results"].append(row)
        record["cost_model_all_budgets"] = step_costs(steps)
        record["stats"] = {k: v for k, v in engine.stats().items() if k in ("graphed_steps", "eager_steps", "mixed_steps")}
        _write(path, record)
        print(f"[offline] {label}: {row['output_tok_s']} tok/s, ITL p50 {row['itl_ms']['p50']} / p99 "
              f"{row['itl_ms']['p99']} / max {row['itl_ms']['max']} ms, TTFT p99 {row['ttft_ms']['p99']} ms, "
              f"{row['steps']['mixed']} mixed steps of median {row['mixed_step_ms_median']} ms", flush=True)
    record["steps_recorded"] = len(steps)
    _write(path, record)
    return record


# ---- served and poisson: `attnserve bench serve` launching the server ----------------------------------------------
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


def _model_flags(p: dict, out: Path, clock: Clock, notes: list[str]) -> tuple[list[str], list[str]]:
    """(server model flags, bench tokenizer flags): a Llama-3-8B config + tokenizer directory on the GPU (the
    servers draw random weights there); the embedded model on a CPU."""
    if p["device"] == "cpu":
        return [], []
    model_dir = out / "llama3-8b-config"
    if not (model_dir / "config.json").exists():
        run([sys.executable, "benchmarks/serve_h200_model.py", str(model_dir), "--no-weights"],
            out / "logs" / "model.log", min(60, clock.left()), "model directory", notes)
    return ["--model", str(model_dir)], ["--tokenizer", str(model_dir)]


def _bench(p: dict, out: Path, clock: Clock, notes: list[str], what: str, compare: list[str], load: list[str],
           json_path: Path, extra: list[str] = (), warmup: int | None = None) -> dict | None:
    model, tokenizer = _model_flags(p, out, clock, notes)
    engine_flags = f"{shlex.join(model)} {p['server']} --chunked-prefill-size {p['chunk']}".strip()
    cmd = [sys.executable, "-m", "attnserve", "bench", "serve", "--dataset-name", "random",
           "--input-len", str(p["input_len"]), "--output-len", str(p["output_len"]), *tokenizer,
           "--warmup-requests", str(p["concurrency"] if warmup is None else warmup), "--no-progress",
           "--server-log-dir", str(out / "logs" / json_path.stem),
           "--max-point-seconds", "90", "--launch", engine_flags, "--compare", *compare, *load, *extra,
           "--title", what, "--json", str(json_path)]
    run(cmd, out / "logs" / f"{json_path.stem}.log", clock.left() - 5, what, notes)
    return _load(json_path)


def _c_point(cfg: dict, concurrency: int) -> dict | None:
    for pt in cfg.get("points", []):
        if pt["load"] == "concurrency" and pt["value"] == concurrency and pt["median"].get("completed"):
            return pt["median"]
    return None


def step_served(p: dict, out: Path, clock: Clock, notes: list[str], budgets: list[str]) -> dict | None:
    labels = [budget_label(b) for b in budgets]
    compare = [f"{label}={budget_flag(label)}" for label in labels]
    rep = _bench(p, out, clock, notes, f"step budgets at c={p['concurrency']}", compare,
                 ["--concurrency", str(p["concurrency"]), "--num-prompts", str(p["num_prompts"])],
                 out / "served.json")
    return rep


def step_poisson(p: dict, out: Path, clock: Clock, notes: list[str]) -> dict | None:
    rates = p["rates"].split(",")
    return _bench(p, out, clock, notes, "the default budget under Poisson arrivals", ["default="],
                  ["--request-rate", p["rates"], "--num-prompts", ",".join([str(p["rate_prompts"])] * len(rates)),
                   "--goodput", *(f"{k}:{v}" for k, v in SLO.items())], out / "poisson.json")


def step_c1(p: dict, out: Path, clock: Clock, notes: list[str]) -> dict:
    """One stream: the served TPOT at the default budget against the offline engine's decode step at batch 1
    (the target: TPOT <= 1.02x the step). The server first (then its GPU memory is free), the engine after."""
    import torch

    n_in, n_out, prompts = p["input_len"], p["output_len"], p["c1_prompts"]
    path = out / "c1.json"
    record = _header(p, notes, f"one stream, {p['preset']} random weights, {p['backend']}, {n_in} in / {n_out} out, "
                               f"the default budget: served TPOT (bench serve, c=1, {prompts} requests) against the "
                               "offline engine's decode step at batch 1 (the same settings, one request at a time)")
    served = _bench(p, out, clock, notes, "one stream at the default budget", ["default="],
                    ["--concurrency", "1", "--num-prompts", str(prompts)], out / "c1-served.json", warmup=2)
    point = next((pt["median"] for cfg in (served or {}).get("configs", []) for pt in cfg.get("points", [])
                  if pt["median"].get("completed")), None)
    if point:
        record["served"] = {k: point[k] for k in ("completed", "output_tok_s", "ttft_ms", "tpot_ms", "itl_ms")}
        record["served"]["engine"] = point.get("engine")
    _write(path, record)
    if clock.left() < 60:
        notes.append(f"c1 offline: not run, {clock.left():.0f} s left")
        return record
    engine, vocab = offline_engine(p)
    g = torch.Generator().manual_seed(1)
    run_wave(engine, [torch.randint(0, vocab, (n_in,), generator=g).tolist()], min(n_out, 8), [])  # warm-up
    waves = []
    for _ in range(3):
        if clock.left() < 15:
            break
        waves.append(run_wave(engine, [torch.randint(0, vocab, (n_in,), generator=g).tolist()], n_out, []))
    if waves:
        step = statistics.median(w["decode_step_ms_median"] for w in waves)
        record["offline"] = {"requests": len(waves), "decode_step_ms_median": step,
                             "itl_ms_p50": statistics.median(w["itl_ms"]["p50"] for w in waves),
                             "output_tok_s": statistics.median(w["output_tok_s"] for w in waves)}
        if point and point["tpot_ms"]["p50"]:
            record["served_tpot_p50_over_offline_step"] = round(point["tpot_ms"]["p50"] / step, 3)
    _write(path, record)
    print(f"[c1] served TPOT p50 {(point or {}).get('tpot_ms', {}).get('p50')} ms, offline decode step "
          f"{(record.get('offline') or {}).get('decode_step_ms_median')} ms: "
          f"{record.get('served_tpot_p50_over_offline_step')}x", flush=True)
    return record


# ---- the merged record -----------------------------------------------------------------------------------------
def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _stated_budget(config: dict) -> str | None:
    """The budget label ("2048", "off", "auto", ...) a launched server's start-up log states, if it does."""
    for line in (config.get("server_info") or {}).get("startup_log", []):
        m = re.match(r"\s*step budget: (off|auto(?::\d+)?|\d+)\b", line)
        if m:
            return m.group(1)
    return None


def default_budget(offline: dict | None, *launched: dict | None) -> str | None:
    """The default budget's label: as the first launched server's start-up log states it (the offline run may
    predate a new default), else as the offline engine resolved it."""
    for report in launched:
        for config in (report or {}).get("configs", []):
            if config["label"] == "default" and _stated_budget(config):
                return _stated_budget(config)
    return (offline or {}).get("default_budget")


def budget_rows(offline: dict | None, served: dict | None, concurrency: int) -> list[dict]:
    """One row per budget: the offline engine (throughput, the stalls its streams saw) beside the server at
    c=`concurrency` with the same budget. The server's `default` joins the offline row of the budget the
    default resolves to (auto on a GPU)."""
    off = {r["budget"]: r for r in (offline or {}).get("results", [])}
    default = default_budget(offline, served)
    configs = (served or {}).get("configs", [])

    def key(label: str) -> str:
        return default if label == "default" and default in off else label

    srv = {key(c["label"]): c for c in configs}
    rows = []
    for b in list(off) + [b for b in srv if b not in off]:
        if b == "default":
            name = f"default ({default})" if default else b
        else:
            name = f"{b} (default)" if b == default else b
        row = {"budget": name}
        o = off.get(b)
        if o:
            row.update(offline_out_tok_s=o["output_tok_s"], offline_itl_p50_ms=o["itl_ms"]["p50"],
                       offline_itl_p99_ms=o["itl_ms"]["p99"], offline_itl_max_ms=o["itl_ms"]["max"],
                       offline_ttft_p99_ms=o["ttft_ms"]["p99"], offline_decode_step_ms=o["decode_step_ms_median"],
                       mixed_steps=o["steps"]["mixed"], mixed_step_ms=o["mixed_step_ms_median"])
        m = _c_point(srv.get(b) or {}, concurrency)
        if m:
            row.update(out_tok_s=m["output_tok_s"], tpot_p50_ms=m["tpot_ms"]["p50"], itl_p50_ms=m["itl_ms"]["p50"],
                       itl_p99_ms=m["itl_ms"]["p99"], ttft_p50_ms=m["ttft_ms"]["p50"], ttft_p99_ms=m["ttft_ms"]["p99"],
                       completed=m["completed"])
            engine = m.get("engine") or {}
            if engine:  # the server's engine during the point: how busy, and its steps (vs the offline waves')
                row.update(served_engine_busy=engine.get("busy_fraction"),
                           served_mixed_steps=engine.get("mixed_steps"),
                           served_mixed_step_ms=engine.get("mixed_step_ms_mean"),
                           served_decode_step_ms=engine.get("decode_step_ms_mean"))
            row["out_vs_offline"] = _ratio(row.get("out_tok_s"), row.get("offline_out_tok_s"))
            row["itl_p99_over_p50"] = _ratio(row.get("itl_p99_ms"), row.get("itl_p50_ms"))
        rows.append(row)
    return rows


def poisson_rows(rep: dict | None) -> tuple[list[dict], float | None]:
    """Per request rate of the default configuration, and the highest rate within the SLO that every lower rate
    measured also meets (a rate that passes above one that misses is noise, not capacity)."""
    rows = []
    cfg = ((rep or {}).get("configs") or [{}])[0]
    for pt in cfg.get("points", []):
        if pt["load"] != "rate" or not pt["median"].get("completed"):
            continue
        m = pt["median"]
        row = {
            "rate": pt["value"], "completed": m["completed"], "out_tok_s": m["output_tok_s"],
            "ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
            "tpot_p50_ms": m["tpot_ms"]["p50"], "itl_p50_ms": m["itl_ms"]["p50"], "itl_p99_ms": m["itl_ms"]["p99"],
            "goodput_req_s": (m.get("goodput") or {}).get("request_goodput"),
        }
        row["within_slo"] = (row["ttft_p99_ms"] is not None and row["ttft_p99_ms"] <= SLO["ttft"]
                             and row["itl_p99_ms"] is not None and row["itl_p99_ms"] <= SLO["tpot"])
        rows.append(row)
    best = None
    for row in sorted((r for r in rows if r["rate"] != "inf"), key=lambda r: r["rate"]):
        if not row["within_slo"]:
            break
        best = row["rate"]
    return rows, best


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(nothing measured)"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    out = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    out += ["| " + " | ".join("-" if r.get(k) is None else str(r[k]) for k in keys) + " |" for r in rows]
    return out


def plot_budgets(rows: list[dict], path: Path) -> None:
    """The frontier: output tok/s against ITL p99, one point per budget (offline engine, and the server where it
    ran), the default marked: the budgets up and to the left are the ones worth choosing among."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for itl, tok, style, label in (("offline_itl_p99_ms", "offline_out_tok_s", "s", "offline engine"),
                                   ("itl_p99_ms", "out_tok_s", "o", "server (c=64)")):
        pts = [(r[itl], r[tok], r["budget"]) for r in rows if r.get(itl) and r.get(tok)]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, alpha=0.8)
        for x, y, name in pts:
            default = "default" in name
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8,
                        fontweight="bold" if default else "normal")
            if default:
                ax.plot([x], [y], "*", markersize=16, color="crimson", zorder=5)
    ax.plot([], [], "*", markersize=12, color="crimson", label="the default")
    ax.set_xscale("log")
    ax.set_xlabel("ITL p99 (ms, log scale)")
    ax.set_ylabel("output tok/s")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("--max-num-batched-tokens: throughput against the stall streams see (closed loop)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def one_stream_line(c1: dict | None) -> str:
    if not c1 or "offline" not in c1 or "served" not in c1:
        return "not measured"
    return (f"served TPOT p50 {c1['served']['tpot_ms']['p50']} ms against the offline decode step at batch 1 "
            f"{c1['offline']['decode_step_ms_median']} ms: {c1.get('served_tpot_p50_over_offline_step')}x "
            "(target <= 1.02x)")


def merge(out: Path, p: dict, notes: list[str], offline_json: Path | None = None) -> dict:
    """serve-budget.{json,md} and budget.png from whatever steps wrote under `out` (offline.json there, else
    `offline_json`: an earlier call's offline step)."""
    offline_path = out / "offline.json"
    if not offline_path.exists() and offline_json is not None:
        offline_path = offline_json
    offline, served, poisson = _load(offline_path), _load(out / "served.json"), _load(out / "poisson.json")
    c1 = _load(out / "c1.json")
    rows = budget_rows(offline, served, p["concurrency"])
    rate_rows, best = poisson_rows(poisson)
    prior = _load(out / "serve-budget.json") or {}
    record = {
        "what": f"random {p['input_len']} in / {p['output_len']} out, {p['concurrency']} streams, chunks of "
                f"{p['chunk']}; server flags: {p['server']}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": (served or poisson or {}).get("gpu") or (offline or {}).get("device"),
        "versions": (offline or {}).get("versions") or _versions(),
        "default_budget": default_budget(offline, served, poisson),
        "slo_ms": SLO,
        "budget_sweep": rows,
        "cost_model": (offline or {}).get("cost_model_all_budgets"),
        "poisson": rate_rows,
        "highest_rate_within_slo": best,
        "one_stream": {k: c1[k] for k in ("served", "offline", "served_tpot_p50_over_offline_step") if k in c1}
        if c1 else None,
        "notes": list(dict.fromkeys([*prior.get("notes", []), *notes, *(offline or {}).get("notes", [])])),
        "inputs": {k: str(path) for k, path in (("offline", offline_path), ("served", out / "served.json"),
                                                ("poisson", out / "poisson.json"), ("c1", out / "c1.json"))
                   if path.exists()},
    }
    _write(out / "serve-budget.json", record)
    cm = record["cost_model"] or {}
    cost = (f"mixed step = {cm['mixed']['fixed_ms']} ms + {cm['mixed']['per_prompt_token_us']} us x prompt tokens + "
            f"{cm['mixed']['per_decode_ms']} ms x decodes; decode step = {cm['decode']['fixed_ms']} ms + "
            f"{cm['decode']['per_decode_ms']} ms x decodes; a mixed step's fixed cost beyond a decode step: "
            f"{cm.get('mixed_fixed_over_decode_ms')} ms" if "mixed" in cm and "decode" in cm else "not fitted")
    md = [f"# Step token budget: {record['what']}", "", f"- {record['date']}, {record['gpu']}",
          f"- default budget here: {record['default_budget']}", f"- cost model (offline, every step): {cost}",
          *(f"- note: {n}" for n in record["notes"]), "", "## Budgets (closed loop)", "", *_table(rows), "",
          f"## Poisson, the default budget (SLO: TTFT p99 <= {SLO['ttft']} ms, ITL p99 <= {SLO['tpot']} ms; goodput "
          f"counts TPOT <= {SLO['tpot']} ms)", "", *_table(rate_rows), "",
          f"Highest rate within the SLO: {best if best is not None else 'none measured'}", "",
          "## One stream (c=1, the default budget)", "", one_stream_line(record["one_stream"])]
    (out / "serve-budget.md").write_text("\n".join(md) + "\n")
    plot_budgets(rows, out / "budget.png")
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=STEPS, help="offline, served, poisson, report (merge only) or all")
    ap.add_argument("out", type=Path, help="folder for every result and log (the steps of one run share it)")
    ap.add_argument("--quick", action="store_true", help="tiny CPU dry run (embedded model for the servers)")
    ap.add_argument("--cpu", action="store_true", help="the sweep on a CPU with the embedded model")
    ap.add_argument("--budgets", help="offline: the budgets, in order (default GPU: " + GPU["offline_budgets"] + ")")
    ap.add_argument("--served-budgets", help="served: the budgets launched (default: " + GPU["served_budgets"] + ")")
    ap.add_argument("--waves", type=int, help="offline: closed waves per budget")
    ap.add_argument("--rates", help="poisson: request rates of the default configuration")
    ap.add_argument("--server-flags", help="flags of every launched server besides model, chunk and budget")
    ap.add_argument("--eager-mixed", action="store_true",
                    help="the offline engine and every server with --disable-piecewise-cuda-graph (prompt-carrying "
                    "steps eager)")
    ap.add_argument("--pool-tokens", type=int, help="offline and c1: the KV pool's tokens (default: what the waves need)")
    ap.add_argument("--deadline-s", type=float, help="seconds for the step (the whole of it, all for `all`)")
    ap.add_argument("--offline-json", type=Path,
                    help="an earlier offline step's offline.json, merged when OUT has none (its rows beside the server's)")
    args = ap.parse_args()
    p = dict(QUICK if args.quick else CPU if args.cpu else GPU)
    for key, attr in (("offline_budgets", "budgets"), ("served_budgets", "served_budgets"), ("waves", "waves"),
                      ("rates", "rates"), ("deadline_s", "deadline_s"), ("server", "server_flags"),
                      ("pool_tokens", "pool_tokens")):
        if getattr(args, attr) is not None:
            p[key] = getattr(args, attr)
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    clock, notes = Clock(p["deadline_s"]), []
    if args.eager_mixed:
        p["eager_mixed"] = True
        p["server"] += " --disable-piecewise-cuda-graph"
        notes.append("piecewise CUDA graphs off (--disable-piecewise-cuda-graph) in the offline engine and every server")
    steps = ("offline", "served", "poisson", "c1") if args.step == "all" else (args.step,)
    ok = True
    for step in steps:
        started = time.monotonic()
        try:
            if step == "offline":
                rec = step_offline(p, out, clock, notes, p["offline_budgets"].split(","))
                ok &= bool(rec["results"])
            elif step == "served":
                rep = step_served(p, out, clock, notes, p["served_budgets"].split(","))
                ok &= bool(rep and any(_c_point(c, p["concurrency"]) for c in rep.get("configs", [])))
            elif step == "poisson":
                ok &= bool(poisson_rows(step_poisson(p, out, clock, notes))[0])
            elif step == "c1":
                ok &= "served_tpot_p50_over_offline_step" in step_c1(p, out, clock, notes)
        except Exception as exc:  # noqa: BLE001 - the merged record is written whatever failed
            import traceback

            traceback.print_exc()
            notes.append(f"{step}: {type(exc).__name__}: {exc}"[:400])
            ok = False
        print(f"[{step}] {time.monotonic() - started:.0f} s", flush=True)
    record = merge(out, p, notes, args.offline_json)
    print((out / "serve-budget.md").read_text(), flush=True)
    return 0 if ok and (record["budget_sweep"] or record["poisson"]) else 1


if __name__ == "__main__":
    sys.exit(main())
