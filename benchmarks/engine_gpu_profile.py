"""Where a full-batch decode step's time goes, and what a mixed step costs beside it.

Same workload as engine_gpu_decode.py (Llama-3-8B shape, random bf16 weights,
--requests x --input-len prompts). For each mode (eager / CUDA graphs) and each
op setting (fused ops on / off) one engine prefills every request (step budget off:
the budget shapes prefill only, and the profile times decode), runs until every request
decodes, then:

- step wall time: median of --steps full-batch decode steps, timed on the host
  (Engine.step returns once the sampled tokens are on the host);
- kernel time by kind (GEMM / attention / elementwise / other) from torch.profiler
  over another --steps steps: what the GPU is busy with per step;
- host gap = step wall - kernel busy time: the time per step the GPU waits for the
  host (scheduling, metadata, planning, launches, sampling sync).

Kernels inside a CUDA graph replay are recorded by CUPTI on recent drivers; where they
are not (`kernels_visible` false), the graph mode's busy time falls back to the eager
run's with the same ops.

Mixed steps (`--mixed-chunks N,...`): on one engine (graphs, fused ops) with the full batch
decoding, one more request of an N-token prompt joins, so the next step is MIXED: the
--requests decodes plus the N-token chunk (budget off, the chunk is whole; the request asks
for one token, so it ends in that step and the batch stays full). Overlap scheduling is off
there, so each step is timed alone: wall (host, launch to tokens), GPU kernel time by kind
and the host gap, against the same engine's full-batch decode step. N >= 2 (a one-token
prompt beside decodes makes a decode step); N = 2 is a mixed step of decodes and almost no
prompt (eager, planned as a mixed step): what being mixed costs before the prompt tokens
count. The least-squares line wall(N) = a + b * N over N >= `--fit-from` gives the per-token
cost b and the fixed cost a; a - decode step is what a mixed step costs beyond a decode step
besides its tokens (the step budget's cost model: schedule_policy.py). `--split-mixed on,off`
measures both ways the triton backend can run a mixed step (its decodes through the decode
kernel, or the whole step through the extend path) on the same engine.

    PYTHONPATH=src python3 benchmarks/engine_gpu_profile.py --out benchmarks/results/engine_gpu_profile.json
    PYTHONPATH=src python3 benchmarks/engine_gpu_profile.py --modes none --mixed-chunks 2,256,512,1024,2048,8192
    PYTHONPATH=src python3 benchmarks/engine_gpu_profile.py --device cpu --preset smollm2-135m --requests 4 \
        --input-len 32 --steps 2 --mixed-chunks 2,16,64 --fit-from 16 --out /tmp/profile.json   # script check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
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


def kernel_times(prof, device: str) -> tuple[dict[str, float], dict[str, int]]:
    """Total device microseconds, and launches, per kernel name over the profiled steps (aten ops' own time
    on a CPU)."""
    by_name: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for ev in prof.key_averages():  # CUDA activity only: every entry is a kernel, copy or memset
        if device == "cpu":
            t = ev.self_cpu_time_total if ev.key.startswith("aten::") else 0
        else:
            t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t:
            by_name[ev.key] += t
            launches[ev.key] += ev.count
    return by_name, launches


def _engine(loaded, args, new_tokens: int, joining_prompt: int = 0, **overrides):
    """An engine for --requests prompts that each generate `new_tokens`, with a row and pages for one more
    request of `joining_prompt` tokens when that is > 0; the step budget off, chunks of at least 8192."""
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine

    cpu = args.device == "cpu"
    extra = 1 if joining_prompt else 0
    settings = dict(device=args.device, attention_backend=args.attention_backend or ("torch_native" if cpu else "triton"),
                    cuda_graph_max_bs=args.requests + extra, max_running_requests=args.requests + extra,
                    disable_radix_cache=True, max_num_batched_tokens=0,
                    max_total_tokens=args.requests * (args.input_len + new_tokens + 64) + joining_prompt + 2048,
                    chunked_prefill_size=max(8192, joining_prompt))
    settings.update(overrides)
    return Engine(EngineConfig(**settings), loaded=loaded)


def _add_batch(engine, loaded, args, g, new_tokens: int) -> list:
    from attnserve.engine.sampling_params import SamplingParams

    vocab = loaded.config.vocab_size
    return [engine.add_request(torch.randint(0, vocab, (args.input_len,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            for _ in range(args.requests)]


def _to_full_decode(engine, args) -> None:
    """Step until every request decodes (nothing waits, nothing prefills), then three steps more."""
    sched = engine.scheduler
    for _ in range(100_000):
        if not sched.waiting and not any(r.is_prefilling for r in sched.running):
            break
        engine.step()
    for _ in range(3):
        engine.step()
    if len(sched.running) != args.requests:
        raise RuntimeError(f"expected {args.requests} requests decoding, {len(sched.running)} are running")


def _by_kind(prof, device: str, steps: int) -> tuple[dict, float, list, dict]:
    """(ms per step by kind, busy ms per step, (name, total us, launches) heaviest first, launches per step by
    kind)."""
    by_name, launches = kernel_times(prof, device)
    by_kind: dict[str, float] = defaultdict(float)
    count_by_kind: dict[str, int] = defaultdict(int)
    for name, t in by_name.items():
        by_kind[kind_of(name)] += t
        count_by_kind[kind_of(name)] += launches[name]
    per_step = {k: round(v / steps / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    busy = sum(by_kind.values()) / steps / 1e3
    counts = {k: round(v / steps, 1) for k, v in sorted(count_by_kind.items(), key=lambda kv: -kv[1])}
    heaviest = sorted(((name, t, launches[name]) for name, t in by_name.items()), key=lambda e: -e[1])
    return per_step, busy, heaviest, counts


def _release(cpu: bool) -> None:
    """After the caller dropped its engine: its KV pool and graphs go back before the next one is built."""
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _fused_ops_without(name: str | None):
    """While an engine is built: the fused op set with its op `name` left to the unfused path (None: whole), so
    one fusion's gain is measured against the same engine without it."""
    from attnserve.ops import select

    if name is None:
        yield
        return
    whole = select.triton_ops
    if not hasattr(whole(), name):
        raise SystemExit(f"--fused no-{name}: the op set has no op {name!r}")
    select.triton_ops = lambda pdl=False: dataclasses.replace(whole(pdl), **{name: None})
    try:
        yield
    finally:
        select.triton_ops = whole


def _use_min_split_tokens(engine, tokens: int) -> None:
    """The decode backend's split policy, cutting no request into chunks under `tokens` keys. A captured graph's
    split dimension comes from its batch size alone (split_plan.max_splits_for_batch), so replays follow it."""
    backend = engine.parts.backend
    side = getattr(backend, "decode_backend", backend)
    if not hasattr(side, "split_policy"):
        raise SystemExit(f"--fused split-{tokens}: the decode backend {type(side).__name__} has no split policy")
    side.split_policy = dataclasses.replace(side.split_policy, min_split_tokens=tokens)


def profile_config(loaded, args, graphs: bool, fused: str) -> dict:
    """One engine's decode steps; `fused` is on, off, pdl (on, launched with PDL), no-<op> (on but that one) or
    split-<N> (on, the decode split policy's min_split_tokens N)."""
    from torch.profiler import ProfilerActivity, profile

    cpu = args.device == "cpu"
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    without = fused.removeprefix("no-") if fused.startswith("no-") else None
    split_tokens = int(fused.removeprefix("split-")) if fused.startswith("split-") else None
    with _fused_ops_without(without):
        engine = _engine(loaded, args, 3 * args.steps + 16, disable_cuda_graph=not graphs,
                         disable_fused_ops=fused == "off", enable_pdl=fused == "pdl")
    if split_tokens is not None:
        _use_min_split_tokens(engine, split_tokens)
    g = torch.Generator().manual_seed(0)
    _add_batch(engine, loaded, args, g, 3 * args.steps + 16)
    _to_full_decode(engine, args)  # the budget is off, and nothing prefills once the timing starts
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
    per_step, busy, by_name, counts = _by_kind(prof, args.device, args.steps)
    wall = statistics.median(walls) * 1e3
    top = by_name[: args.top]
    for rid in list(engine.requests):  # stop the rest; every page must come back
        engine.abort(rid)
    engine.drain()
    out = {
        "mode": "graphs" if graphs else "eager",
        "fused_ops": fused != "off",
        "pdl": fused == "pdl",
        **({"unfused_op": without} if without else {}),
        **({"min_split_tokens": split_tokens} if split_tokens is not None else {}),
        "ops": engine.parts.model.module.ops.name,
        "graphed_steps": engine.runner.steps_graphed,
        "step_wall_ms_median": round(wall, 3),
        "kernel_busy_ms_per_step": round(busy, 3),
        "kernels_visible": busy > 0.2 * wall,
        "per_step_ms_by_kind": per_step,
        "host_gap_ms_per_step": round(wall - busy, 3),
        "kernel_launches_per_step": counts,
        "top_kernels_ms_per_step": [(n[:120], round(t / args.steps / 1e3, 3)) for n, t, _ in top],
        "top_kernels_launches_per_step": [round(c / args.steps, 1) for _, _, c in top],
        "pages_leaked": engine.pages_leaked(),
    }
    del engine
    _release(cpu)
    return out


def _fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares wall = a + b * tokens: (a ms, b ms per token), or None with fewer than two sizes."""
    if len({n for n, _ in points}) < 2:
        return None
    xs, ys = [n for n, _ in points], [w for _, w in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _split_backends(engine) -> list:
    """The triton backend(s) that can run a mixed step split (the prefill side of a hybrid runs mixed steps)."""
    backend = engine.parts.backend
    side = getattr(backend, "prefill_backend", backend)
    return [side] if hasattr(side, "split_mixed") and type(side).SPLIT_MIXED else []


def profile_mixed(loaded, args, on_done=None) -> dict:
    """Mixed steps of --requests decodes plus an N-token chunk, against the same engine's decode step."""
    from torch.profiler import ProfilerActivity, profile

    from attnserve.engine.sampling_params import SamplingParams

    cpu = args.device == "cpu"
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    reps = args.steps
    splits = [s == "on" for s in args.split_mixed.split(",")]
    # enough tokens for every step below: prefill, decode steps, then per size and split setting warm + timed + profiled
    new_tokens = 3 * reps + 16 + len(args.mixed) * len(splits) * (2 + 2 * reps)
    pieces = dict(disable_piecewise_cuda_graph=True)  # the mixed steps eager, unless --piecewise
    if args.piecewise:  # every mixed step below in piecewise graphs (the decode step replays its own graph)
        pieces = dict(piecewise_cuda_graph_max_tokens=max(args.mixed) + args.requests)
    engine = _engine(loaded, args, new_tokens, joining_prompt=max(args.mixed), disable_overlap_schedule=True,
                     **pieces)
    if not _split_backends(engine):
        splits = [None]  # the backend has one way to run a mixed step
    g = torch.Generator().manual_seed(1)
    vocab = loaded.config.vocab_size
    _add_batch(engine, loaded, args, g, new_tokens)
    _to_full_decode(engine, args)
    sync()

    def timed(n: int) -> float:
        """One step; with n > 0 a request of an n-token prompt joins it (and ends in it: one token)."""
        if n:
            engine.add_request(torch.randint(0, vocab, (n,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=1, ignore_eos=True))
        sync()
        t = time.perf_counter()
        done = engine.step()
        wall = time.perf_counter() - t
        assert len(done) == args.requests + (1 if n else 0), f"{len(done)} requests in the step, expected a full batch"
        return wall * 1e3

    decode = [timed(0) for _ in range(reps + 2)][2:]
    with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            timed(0)
        sync()
    d_kinds, d_busy, _, _ = _by_kind(prof, args.device, reps)
    out = {
        "what": f"{args.requests} decodes (context ~{args.input_len}) plus one prompt chunk of N tokens, one step, "
                f"overlap off{', in piecewise CUDA graphs' if args.piecewise else ', eager'}; ms per step",
        "decode_step": {"wall_ms_median": round(statistics.median(decode), 3), "kernel_busy_ms": round(d_busy, 3),
                        "per_step_ms_by_kind": d_kinds},
        "rows": [], "fits": {},
    }
    for split in splits:
        for side in _split_backends(engine):
            side.split_mixed = bool(split)
        label = "n/a" if split is None else ("on" if split else "off")
        for n in args.mixed:
            walls = [timed(n) for _ in range(2 + reps)][2:]  # two warm steps first (compiles, first use)
            with profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    timed(n)
                sync()
            kinds, busy, by_name, _ = _by_kind(prof, args.device, reps)
            wall = statistics.median(walls)
            row = {
                "split_mixed": label, "chunk_tokens": n, "wall_ms_median": round(wall, 3),
                "wall_ms_min": round(min(walls), 3), "kernel_busy_ms": round(busy, 3),
                "host_gap_ms": round(wall - busy, 3), "per_step_ms_by_kind": kinds,
                "over_decode_step_ms": round(wall - out["decode_step"]["wall_ms_median"], 3),
                "top_kernels_ms_per_step": [(k[:100], round(t / reps / 1e3, 3)) for k, t, _ in by_name[:8]],
            }
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels_ms_per_step"}), flush=True)
            if on_done is not None:
                on_done(out)
        fit = _fit([(r["chunk_tokens"], r["wall_ms_median"]) for r in out["rows"]
                    if r["split_mixed"] == label and r["chunk_tokens"] >= args.fit_from])
        if fit is not None:
            a, b = fit
            out["fits"][label] = {
                "fixed_ms": round(a, 3), "per_token_us": round(b * 1e3, 3),
                "fixed_over_decode_step_ms": round(a - out["decode_step"]["wall_ms_median"], 3),
                "from_chunk_tokens": args.fit_from,
            }
    for side in _split_backends(engine):
        side.split_mixed = True
    if args.host_profile:  # where the host's time goes in a mixed step (the kernels' own time is above)
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            timed(args.host_profile)
        prof.disable()
        out["host_profile"] = {"chunk_tokens": args.host_profile, **host_top(prof, reps)}
        if on_done is not None:
            on_done(out)
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.drain()
    out["pages_leaked"] = engine.pages_leaked()
    out["eager_steps"] = engine.runner.steps_eager
    out["piecewise_steps"] = engine.runner.steps_piecewise
    out["startup_graphs"] = [line for line in engine.parts.startup_lines if line.startswith("CUDA graphs")]
    del engine
    _release(cpu)
    return out


def host_top(prof, steps: int, top: int = 40) -> dict:
    """cProfile's functions, per step in ms: the top by own time and by cumulative time (callees included)."""
    import pstats

    rows = []
    for (file, line, func), (_cc, calls, own, cum, _callers) in pstats.Stats(prof).stats.items():
        where = "/".join(file.split("/")[-2:])
        rows.append({"function": f"{where}:{line}({func})", "calls": round(calls / steps, 1),
                     "own_ms": round(own / steps * 1e3, 3), "cum_ms": round(cum / steps * 1e3, 3)})
    return {"by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "by_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:top]}


def print_mixed(mixed: dict) -> None:
    d = mixed["decode_step"]
    print(f"decode step: wall {d['wall_ms_median']:.3f} ms, kernels {d['kernel_busy_ms']:.3f} ms")
    print(f"{'split':6} {'chunk':>6} {'wall':>9} {'busy':>9} {'host gap':>9} {'- decode':>9}  attention / gemm / elementwise")
    for r in mixed["rows"]:
        k = r["per_step_ms_by_kind"]
        print(f"{r['split_mixed']:6} {r['chunk_tokens']:6d} {r['wall_ms_median']:9.3f} {r['kernel_busy_ms']:9.3f} "
              f"{r['host_gap_ms']:9.3f} {r['over_decode_step_ms']:9.3f}  {k.get('attention', 0.0):.3f} / "
              f"{k.get('gemm', 0.0):.3f} / {k.get('elementwise', 0.0):.3f}")
    for label, f in mixed["fits"].items():
        print(f"split {label}: wall = {f['fixed_ms']:.3f} ms + {f['per_token_us']:.2f} us x N "
              f"(fixed part {f['fixed_over_decode_step_ms']:+.3f} ms over the decode step)", flush=True)
    host = mixed.get("host_profile")
    if host:
        print(f"host, a mixed step of {host['chunk_tokens']} prompt tokens under cProfile (ms per step):")
        for r in host["by_cum"][:25]:
            print(f"  cum {r['cum_ms']:8.3f}  own {r['own_ms']:8.3f}  calls {r['calls']:7.1f}  {r['function'][:110]}")
        for r in host["by_own"][:20]:
            print(f"  own {r['own_ms']:8.3f}  cum {r['cum_ms']:8.3f}  calls {r['calls']:7.1f}  {r['function'][:110]}")


def print_table(results: list[dict]) -> None:
    kinds = ["gemm", "attention", "elementwise", "other"]
    print(f"{'mode':7} {'fused':6} {'wall':>8} {'busy':>8} {'host gap':>9} " + " ".join(f"{k:>11}" for k in kinds))
    for r in results:
        k = r["per_step_ms_by_kind"]
        fused = (f"no-{r['unfused_op']}" if "unfused_op" in r else f"split-{r['min_split_tokens']}"
                 if "min_split_tokens" in r else "pdl" if r["pdl"] else str(r["fused_ops"]))
        print(f"{r['mode']:7} {fused:6} {r['step_wall_ms_median']:8.3f} "
              f"{r['kernel_busy_ms_per_step']:8.3f} {r['host_gap_ms_per_step']:9.3f} "
              + " ".join(f"{k.get(x, 0.0):11.3f}" for x in kinds), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="eager,graphs", help="comma list of eager, graphs (none: no decode profile)")
    ap.add_argument("--fused", default="on,off",
                    help="comma list of on, off (the --disable-fused-ops switch), pdl (on, launched with --enable-pdl), "
                    "no-<op> (every fused op but that one, e.g. no-mla_rope: what the one fusion gains), split-<N> "
                    "(on, no request's decode keys cut into chunks under N: the split plan's min_split_tokens)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed by name per configuration")
    ap.add_argument("--mixed-chunks", default="",
                    help="comma list of prompt-chunk sizes N: profile a mixed step of --requests decodes plus N prompt "
                    "tokens for each, N >= 2 (e.g. 2,256,512,1024,2048,4096,8192; default: none)")
    ap.add_argument("--split-mixed", default="on,off",
                    help="with --mixed-chunks on the triton backend: on (decodes through the decode kernel), off "
                    "(the whole mixed step through the extend path), or both")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="with --mixed-chunks: also run mixed steps of N prompt tokens under cProfile and record the "
                    "host's top functions per step (0: not)")
    ap.add_argument("--piecewise", action="store_true",
                    help="with --mixed-chunks: the mixed steps replay piecewise CUDA graphs (the engine's GPU default; without it --disable-piecewise-cuda-graph)")
    ap.add_argument("--fit-from", type=int, default=256, help="the line wall = a + b * N fits chunks of >= this")
    ap.add_argument("--out", default="benchmarks/results/engine_gpu_profile.json")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script (torch_native, fp32)")
    ap.add_argument("--attention-backend", default=None,
                    help="default: triton (torch_native on a CPU)")
    args = ap.parse_args()
    args.mixed = [int(n) for n in args.mixed_chunks.split(",") if n.strip()]
    if any(n < 2 for n in args.mixed):
        raise SystemExit("--mixed-chunks: every size must be >= 2 (a one-token prompt beside decodes is a decode step)")

    import triton

    from attnserve.models.loader import load_model

    loaded = load_model(args.preset, dtype="bf16" if args.device == "cuda" else "fp32", device=args.device,
                        random_weights=True)
    results, errors, mixed = [], {}, None
    report = {
        "what": f"{args.preset} random {'bf16' if args.device == 'cuda' else 'fp32'}, {args.requests} x "
                f"{args.input_len}, {'triton' if args.device == 'cuda' else 'torch_native'} backend, per "
                "full-batch decode step: wall, GPU kernel time by kind, host gap (ms)"
                + (f"; mixed steps of {args.requests} decodes + N prompt tokens, N in {args.mixed}" if args.mixed else ""),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (script check only)",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "results": results,
        "errors": errors,
        "command": "PYTHONPATH=src python3 benchmarks/engine_gpu_profile.py " + " ".join(sys.argv[1:]),
    }

    def write(mixed_part=None) -> None:  # after every configuration: a run cut by its time limit keeps what it measured
        if mixed_part is not None:
            report["mixed"] = mixed_part
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    modes = [] if args.modes in ("", "none") else args.modes.split(",")
    for mode in modes:
        for fused in args.fused.split(","):
            label = f"{mode}-fused-{fused}"
            try:
                results.append(profile_config(loaded, args, graphs=mode == "graphs", fused=fused))
                print(json.dumps(results[-1]), flush=True)
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
                errors[label] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                gc.collect()
            write()
    eager_busy = {(r["fused_ops"], r["pdl"]): r for r in results
                  if r["mode"] == "eager" and "unfused_op" not in r and "min_split_tokens" not in r}
    for r in results:  # graph kernels invisible to the profiler: take the eager run's kernel time
        if r["mode"] == "graphs" and not r["kernels_visible"] and (r["fused_ops"], r["pdl"]) in eager_busy:
            e = eager_busy[(r["fused_ops"], r["pdl"])]
            r["kernel_busy_ms_per_step"] = e["kernel_busy_ms_per_step"]
            r["per_step_ms_by_kind"] = e["per_step_ms_by_kind"]
            r["host_gap_ms_per_step"] = round(r["step_wall_ms_median"] - e["kernel_busy_ms_per_step"], 3)
            r["busy_from"] = "eager run (graph kernels not recorded)"
    if results:
        print_table(results)
    write()
    if args.mixed:
        try:
            mixed = profile_mixed(loaded, args, on_done=write)
        except Exception as exc:  # noqa: BLE001
            errors["mixed"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        if mixed is not None:
            write(mixed)
            print_mixed(mixed)
    write()


if __name__ == "__main__":
    main()
