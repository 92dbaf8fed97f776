"""Where a full-batch decode step's time goes: GPU time by kernel kind, and the host gap.

Same workload as engine_gpu_decode.py (Llama-3-8B shape, random bf16 weights,
--requests x --input-len prompts). For each mode (eager / CUDA graphs) and each
op setting (fused ops on / off) one engine prefills every request, then:

- step wall time: median of --steps full-batch decode steps, timed on the host
  (Engine.step returns once the sampled tokens are on the host);
- kernel time by kind (GEMM / attention / elementwise / other) from torch.profiler
  over another --steps steps: what the GPU is busy with per step;
- host gap = step wall - kernel busy time: the time per step the GPU waits for the
  host (scheduling, metadata, planning, launches, sampling sync).

Kernels inside a CUDA graph replay are recorded by CUPTI on recent drivers; where they
are not (`kernels_visible` false), the graph mode's busy time falls back to the eager
run's with the same ops.

    PYTHONPATH=src python3 benchmarks/engine_gpu_profile.py --out benchmarks/results/engine_gpu_profile.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections import defaultdict
from datetime import datetime, timezone

import torch

KINDS = (  # first match wins: GEMM names first (cuBLAS split-K kernels contain "split")
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("_decode_split", "_merge_splits", "_extend_kernel", "attention", "attn", "batchdecode",
                   "batchprefill", "flash")),
    ("elementwise", ("elementwise", "reduce_kernel", "rmsnorm", "silu", "rope", "store", "index", "cat",
                     "copy", "fill", "gather", "scatter", "softmax", "where", "arange", "embedding")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    if "memcpy" in low or "memset" in low:
        return "other"
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernel_times(prof, device: str) -> dict[str, float]:
    """Total device microseconds per kernel name over the profiled steps (aten ops' own time on a CPU)."""
    by_name: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():  # CUDA activity only: every entry is a kernel, copy or memset
        if device == "cpu":
            t = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0
        else:
            t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t:
            by_name[ev.key] += t
    return by_name


def profile_config(loaded, args, graphs: bool, fused: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams

    cpu = args.device == "cpu"
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    engine = Engine(EngineConfig(device=args.device, attention_backend="torch_native" if cpu else "triton",
                                 disable_cuda_graph=not graphs,
                                 disable_fused_ops=not fused, cuda_graph_max_bs=args.requests,
                                 max_running_requests=args.requests, disable_radix_cache=True,
                                 max_total_tokens=args.requests * (args.input_len + 3 * args.steps + 64) + 1024,
                                 chunked_prefill_size=8192), loaded=loaded)
    g = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    for _ in range(args.requests):
        engine.add_request(torch.randint(0, vocab, (args.input_len,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=3 * args.steps + 16, ignore_eos=True))
    while not engine.step_times.decode:  # prefill everything, then one decode step
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    sync()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        batch_size = len(engine.step())
        walls.append(time.perf_counter() - t)
        assert batch_size == args.requests, f"expected full-batch decode steps, got {batch_size} requests"
    with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    by_name = kernel_times(prof, args.device)
    by_kind: dict[str, float] = defaultdict(float)
    for name, t in by_name.items():
        by_kind[kind_of(name)] += t
    per_step = {k: round(v / args.steps / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    busy = sum(by_kind.values()) / args.steps / 1e3
    wall = statistics.median(walls) * 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]
    for rid in list(engine.requests):  # stop the rest; every page must come back
        engine.abort(rid)
    out = {
        "mode": "graphs" if graphs else "eager",
        "fused_ops": fused,
        "ops": engine.parts.model.module.ops.name,
        "graphed_steps": engine.runner.steps_graphed,
        "step_wall_ms_median": round(wall, 3),
        "kernel_busy_ms_per_step": round(busy, 3),
        "kernels_visible": busy > 0.2 * wall,
        "per_step_ms_by_kind": per_step,
        "host_gap_ms_per_step": round(wall - busy, 3),
        "top_kernels_ms_per_step": [(n[:120], round(t / args.steps / 1e3, 3)) for n, t in top],
        "pages_leaked": engine.pages_leaked(),
    }
    del engine
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    return out


def print_table(results: list[dict]) -> None:
    kinds = ["gemm", "attention", "elementwise", "other"]
    print(f"{'mode':7} {'fused':6} {'wall':>8} {'busy':>8} {'host gap':>9} " + " ".join(f"{k:>11}" for k in kinds))
    for r in results:
        k = r["per_step_ms_by_kind"]
        print(f"{r['mode']:7} {r['fused_ops']!s:6} {r['step_wall_ms_median']:8.3f} "
              f"{r['kernel_busy_ms_per_step']:8.3f} {r['host_gap_ms_per_step']:9.3f} "
              + " ".join(f"{k.get(x, 0.0):11.3f}" for x in kinds), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="eager,graphs", help="comma list of eager, graphs")
    ap.add_argument("--fused", default="on,off", help="comma list of on, off (the --disable-fused-ops switch)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by name per configuration")
    ap.add_argument("--out", default="benchmarks/results/engine_gpu_profile.json")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script (torch_native, fp32)")
    args = ap.parse_args()

    import triton

    from attnserve.models.loader import load_model

    loaded = load_model(args.preset, dtype="bf16" if args.device == "cuda" else "fp32", device=args.device,
                        random_weights=True)
    results, errors = [], {}
    for mode in args.modes.split(","):
        for fused in args.fused.split(","):
            label = f"{mode}-fused-{fused}"
            try:
                results.append(profile_config(loaded, args, graphs=mode == "graphs", fused=fused == "on"))
                print(json.dumps(results[-1]), flush=True)
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
                errors[label] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                gc.collect()
    eager_busy = {r["fused_ops"]: r for r in results if r["mode"] == "eager"}
    for r in results:  # graph kernels invisible to the profiler: take the eager run's kernel time
        if r["mode"] == "graphs" and not r["kernels_visible"] and r["fused_ops"] in eager_busy:
            e = eager_busy[r["fused_ops"]]
            r["kernel_busy_ms_per_step"] = e["kernel_busy_ms_per_step"]
            r["per_step_ms_by_kind"] = e["per_step_ms_by_kind"]
            r["host_gap_ms_per_step"] = round(r["step_wall_ms_median"] - e["kernel_busy_ms_per_step"], 3)
            r["busy_from"] = "eager run (graph kernels not recorded)"
    print_table(results)
    report = {
        "what": f"{args.preset} random bf16, {args.requests} x {args.input_len}, triton backend, "
                "per full-batch decode step: wall, GPU kernel time by kind, host gap (ms)",
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (script check only)",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "results": results,
        "errors": errors,
        "command": "PYTHONPATH=src python3 benchmarks/engine_gpu_profile.py",
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
