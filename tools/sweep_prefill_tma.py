"""Sweep the TMA prefill kernel's tiles (attention/kernels/mha/prefill_tma.py) on the race's prefill/extend workloads.

Each workload is first run on the paged extend kernel (the TMA path off): its time is the baseline
of the same run and its output the reference every TMA config must match. Writes JSON with one row
per (workload, config) and `best`, the config with the smallest geometric mean of its time over
the best time per workload (the default in PREFILL_TMA_TILES is taken from it).

    PYTHONPATH=src python3 tools/sweep_prefill_tma.py --out sweep-prefill-tma.json [--budget-s 120]

--gluon adds the Gluon kernel (kernels/mha/prefill_gluon.py, the backend's prefill_kernel="gluon"), checked and
timed the same way (--gluon-set NAME=VALUE[,NAME=VALUE]: once more with the module's switches set so, e.g.
PINGPONG=1, STAGES=3, READ_POOL_ROWS=0 or INDIRECT_ROW_LANES=16; repeatable); --default-only races only the default
config; --kernel-before FILE adds the default config run on another version of prefill_tma.py (e.g. one
`git show REV:src/...` wrote), loaded beside this one, so a change to the kernel is timed against its parent in
the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
import time

import torch

from attnserve.attention.kernels.mha import prefill_tma
from attnserve.attention.kernels.mha.gluon_switches import gluon_settings, parse_gluon_settings
from attnserve.attention.kernels.mha.prefill_tma import PREFILL_TMA_TILES, PrefillTmaConfig
from attnserve.bench.racers import build_race_batch
from attnserve.bench.timing import time_eager
from attnserve.bench.workloads import TINY_WORKLOADS, WORKLOADS, prefill_workload
from attnserve.choice.registry import backend_for_pool

# (block_m, block_n, warps, stages, warp_specialize[, mask_every_tile[, persistent]]). 128 x 128 x 3 stages and
# 256-row tiles do not fit or spill (tools/compile_prefill_tma_sm90.py).
CONFIGS = [PrefillTmaConfig(*c) for c in (
    (128, 128, 8, 2, False), (128, 64, 8, 3, False), (128, 64, 4, 3, False), (128, 128, 8, 2, False, True, 1))]
# warp-specialised (warps = one group), descriptors built by the kernel (the host's do not fit the split query
# tile); swept with --warp-specialized. 128 x 64 over 3 stages, persistent or not, is refused
# (prefill_tma.check_warp_specialized says why).
WS_CONFIGS = [PrefillTmaConfig(*c, device_descriptors=True) for c in (
    (128, 128, 4, 2, True), (128, 128, 4, 2, True, True, 1))] + [
    PrefillTmaConfig(128, 128, 4, 2, True, True, 1, True, kv_head_major=True)]  # the work list KV head by KV head
TINY_CONFIGS = [PrefillTmaConfig(16, 16, 4, 1, False), PrefillTmaConfig(16, 32, 4, 1, False)]


def run_once(rb, **options):
    backend = backend_for_pool("triton", rb.pool, **options)
    meta = backend.plan(rb.fb)
    fn = lambda: backend.forward_extend(rb.q, rb.k, rb.v, rb.layer, rb.fb, meta)  # noqa: E731
    out = fn()
    us = time_eager(fn) if rb.q.is_cuda else 0.0
    return us, out, meta.extend_path


@contextlib.contextmanager
def kernel_from(path: str):
    """The backend's prefill_tma_attention taken from another copy of prefill_tma.py while the block runs."""
    spec = importlib.util.spec_from_file_location("prefill_tma_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    saved = prefill_tma.prefill_tma_attention
    prefill_tma.prefill_tma_attention = module.prefill_tma_attention
    try:
        yield
    finally:
        prefill_tma.prefill_tma_attention = saved


def best_config(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if r.get("us", 0) > 0 and "block_m" in r]
    fastest: dict[str, float] = {}
    for r in ok:
        fastest[r["workload"]] = min(fastest.get(r["workload"], r["us"]), r["us"])
    keys = [f.name for f in dataclasses.fields(PrefillTmaConfig)]
    scores: dict[tuple, list[float]] = {}
    for r in ok:
        scores.setdefault(tuple(r[k] for k in keys), []).append(math.log(r["us"] / fastest[r["workload"]]))
    complete = {k: v for k, v in scores.items() if len(v) >= len(fastest)}  # every workload, in one round or more
    return dict(zip(keys, min(complete, key=lambda k: sum(complete[k]) / len(complete[k])))) if complete else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="sweep-prefill-tma.json")
    p.add_argument("--tiny", action="store_true", help="small shapes, two configs (CPU smoke run)")
    p.add_argument("--workloads", nargs="*")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting configs after this many seconds")
    p.add_argument("--warp-specialized", action="store_true", help="the warp-specialised configs first, then the rest")
    p.add_argument("--best-options", default=None, help="write the best config here as --triton-options JSON")
    p.add_argument("--gluon", action="store_true", help="race the Gluon kernel too")
    p.add_argument("--gluon-set", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                   help="and the Gluon kernel with these module switches (repeatable: a candidate each)")
    p.add_argument("--default-only", action="store_true", help="only the default config of head_dim 128")
    p.add_argument("--kernel-before", default=None, help="another prefill_tma.py, raced at the default config")
    p.add_argument("--prefills", nargs="*", default=[], help="more fresh-prompt shapes, BATCHxTOKENS (e.g. 16x1024)")
    p.add_argument("--extra-last", action="store_true", help="the Gluon and --kernel-before rows after the configs "
                   "(run twice, once each way, to see what the order moves)")
    p.add_argument("--rounds", type=int, default=1, help="race every candidate this many times, the order reversed "
                   "on every other round (a GPU's clocks drift over a sweep): `summary` holds each one's median")
    args = p.parse_args(argv)
    for sets in args.gluon_set:  # a misspelt switch stops the sweep before anything runs
        parse_gluon_settings(sets)
    start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    workloads = [w for w in (TINY_WORKLOADS if args.tiny else WORKLOADS) if w.kind != "decode" and w.mla is None]
    if args.workloads:
        workloads = [w for w in workloads if any(n in w.name for n in args.workloads)]
    workloads += [prefill_workload(*map(int, shape.split("x"))) for shape in args.prefills]
    configs = TINY_CONFIGS if args.tiny else (WS_CONFIGS + CONFIGS if args.warp_specialized else CONFIGS)
    if args.default_only:
        configs = [TINY_CONFIGS[0] if args.tiny else PREFILL_TMA_TILES[128]]
    rows: list[dict] = []
    batches = [build_race_batch(w, device=device, seed=i) for i, w in enumerate(workloads)]
    refs = {}
    for w, rb in zip(workloads, batches):
        us, out, path = run_once(rb, prefill_tma=False)
        refs[w.name] = out.float()
        flops = w.flops(rb.layer.num_heads, rb.layer.head_dim)
        rows.append({"workload": w.name, "kernel": "paged", "us": round(us, 1),
                     "tflops": round(flops / us / 1e6, 1) if us else None, "path": path})
        print(f"{w.name:<22} paged                                      {us:9.1f} us "
              f"{flops / us / 1e6 if us else 0:6.0f} TFLOP/s", flush=True)
    def save():  # after every config, so a run cut short keeps what it measured
        best = best_config(rows)
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
                       "date": time.strftime("%Y-%m-%d", time.gmtime()), "best": best, "rounds": args.rounds,
                       "summary": summary(rows), "rows": rows}, f, indent=1)
        if args.best_options and best:
            with open(args.best_options, "w") as f:
                json.dump({"prefill_tma_config": best}, f)
        return best

    def check(w, rb, row, out, us, path):
        ref = refs[w.name]
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            raise ValueError(f"output differs from the paged kernel's by {err:.2e}")
        flops = w.flops(rb.layer.num_heads, rb.layer.head_dim)
        row |= {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1) if us else None, "rel_err_vs_paged": err,
                "path": path}
        print(f"{w.name:<22} {row['kernel']:<42} {us:9.1f} us {row['tflops'] or 0:6.0f} TFLOP/s", flush=True)

    # every candidate: (row label, the backend's options, what to run it inside, the config's fields for best_config)
    def config_candidate(cfg):
        label = (f"prefill_tma {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} ws={int(cfg.warp_specialize)} "
                 f"p={cfg.persistent} dev={int(cfg.device_descriptors)} kv={int(cfg.kv_head_major)}")
        # prefill_kernel="triton": the backend's default would take the Gluon kernel on long tiles
        return label, {"prefill_tma_config": cfg, "prefill_kernel": "triton"}, contextlib.nullcontext, \
            dataclasses.asdict(cfg)

    extra = ([("prefill_gluon", {"prefill_kernel": "gluon"}, contextlib.nullcontext, {})] if args.gluon else []) + [
        (f"prefill_gluon {sets}", {"prefill_kernel": "gluon"}, lambda sets=sets: gluon_settings(sets), {})
        for sets in args.gluon_set] + (
        [(f"prefill_tma ({args.kernel_before})", {"prefill_tma_config": configs[0], "prefill_kernel": "triton"},
          lambda: kernel_from(args.kernel_before), {})] if args.kernel_before else [])
    def race_candidate(label, options, context, fields, rnd):
        for w, rb in zip(workloads, batches):
            row = {"workload": w.name, "kernel": label, **fields, "round": rnd}
            try:
                with context():
                    us, out, path = run_once(rb, prefill_tma=True, **options)
                check(w, rb, row, out, us, path)
            except Exception as exc:  # noqa: BLE001 - a kernel or config that fails to compile or run is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{w.name:<22} {label} FAILED {row['error']}", flush=True)
            rows.append(row)
        save()

    candidates = [config_candidate(cfg) for cfg in configs]
    candidates = candidates + extra if args.extra_last else extra + candidates
    for rnd in range(args.rounds):
        for label, options, context, fields in candidates if rnd % 2 == 0 else candidates[::-1]:
            if args.budget_s and time.time() - start > args.budget_s:
                break
            race_candidate(label, options, context, fields, rnd)
        if args.budget_s and time.time() - start > args.budget_s:
            print(f"budget spent in round {rnd + 1} of {args.rounds}: the candidates left not run", flush=True)
            break
    print("best:", json.dumps(save()), flush=True)
    for line in summary_lines(rows):
        print(line, flush=True)
    return 0


def summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each workload's candidates: the median of their times over the rounds."""
    times: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r.get("us"):
            times.setdefault(r["workload"], {}).setdefault(r["kernel"], []).append(r["us"])
    return {w: {k: round(statistics.median(v), 1) for k, v in ks.items()} for w, ks in times.items()}


def summary_lines(rows: list[dict]) -> list[str]:
    lines = []
    for w, ks in summary(rows).items():
        base = ks.get("prefill_gluon")
        for k, us in ks.items():
            vs = f"  {base / us:5.3f}x the Gluon default" if base and k != "prefill_gluon" else ""
            lines.append(f"{w:<22} {k:<48} {us:9.1f} us (median){vs}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
