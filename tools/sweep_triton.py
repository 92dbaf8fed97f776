"""Sweep the Triton kernels' tiles, warps, pipeline stages and split waves on the race workloads.

Prints one line per (workload, setting) and writes JSON; docs/kernels.md records
what each setting gave and which defaults were chosen from it.

    PYTHONPATH=src python3 tools/sweep_triton.py --out sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import traceback

import torch

from attnserve.attention.kernels.mha.configs import DecodeConfig
from attnserve.attention.kernels.mha.extend import ExtendConfig
from attnserve.bench.racers import build_race_batch
from attnserve.bench.timing import time_eager, time_graph
from attnserve.bench.workloads import TINY_WORKLOADS, WORKLOADS
from attnserve.choice.registry import backend_for_pool

DECODE_CONFIGS = [DecodeConfig(bn, w, s) for bn, (w, s) in itertools.product(
    (32, 64, 128), ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3)))]
# the shipped extend tile first, then GQA packing against it and the tiles around it
EXTEND_CONFIGS = [ExtendConfig(*c) for c in (
    (128, 64, 4, 3, False), (128, 64, 4, 3, True), (128, 64, 4, 4, True), (128, 64, 4, 2, True),
    (64, 64, 4, 3, True), (128, 32, 4, 3, True), (128, 128, 8, 3, True))]
# the extend kernel's variants: GQA packing on and off
EXTEND_VARIANTS = [ExtendConfig(128, 64, 4, 3, pack_gqa=p) for p in (False, True)]
WAVES = (0.5, 1.0, 2.0, 4.0, 8.0)


def measure(rb, **options) -> tuple[float, int, torch.Tensor]:
    backend = backend_for_pool("triton", rb.pool, **options)
    meta = backend.plan(rb.fb)
    if rb.workload.kind == "decode":
        fn = lambda: backend.forward_decode(rb.q, rb.layer, rb.fb, meta)
        out = fn()
        return (time_graph(fn) if rb.q.is_cuda else 0.0), meta.decode.max_splits, out
    fn = lambda: backend.forward_extend(rb.q, rb.k, rb.v, rb.layer, rb.fb, meta)
    out = fn()
    return (time_eager(fn) if rb.q.is_cuda else 0.0), 0, out


def rate(rb, us: float) -> str:
    w, lay = rb.workload, rb.layer
    if us <= 0:
        return ""
    if w.kind == "decode":
        return f"{w.kv_bytes(lay.num_kv_heads, lay.head_dim, 2) / us / 1e6:.2f} TB/s"
    return f"{w.flops(lay.num_heads, lay.head_dim) / us / 1e6:.0f} TFLOP/s"


def best_extend_config(rows: list[dict]) -> dict | None:
    """The setting with the smallest geometric mean of (its time / the best time) over the workloads."""
    keys = tuple(f.name for f in dataclasses.fields(ExtendConfig))
    ok = [r for r in rows if r.get("us", 0) > 0]
    fastest = {}
    for r in ok:
        fastest[r["workload"]] = min(fastest.get(r["workload"], r["us"]), r["us"])
    scores: dict[tuple, list[float]] = {}
    for r in ok:
        scores.setdefault(tuple(r.get(k, getattr(ExtendConfig, k)) for k in keys), []).append(math.log(r["us"] / fastest[r["workload"]]))
    complete = {k: v for k, v in scores.items() if len(v) == len(fastest)}
    if not complete:
        return None
    best = min(complete, key=lambda k: sum(complete[k]))
    return dict(zip(keys, best))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="sweep.json")
    p.add_argument("--tiny", action="store_true", help="small shapes, two settings each (CPU smoke run)")
    p.add_argument("--workloads", nargs="*")
    p.add_argument("--kinds", nargs="*", default=["decode", "prefill", "extend"])
    p.add_argument("--variants", action="store_true", help="extend: the kernel-variant list instead of tiles")
    p.add_argument("--best-extend", default=None,
                   help="write the extend config with the best geometric-mean time here, as --triton-options JSON")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    workloads = TINY_WORKLOADS if args.tiny else WORKLOADS
    if args.workloads:
        workloads = [w for w in workloads if any(n in w.name for n in args.workloads)]
    workloads = [w for w in workloads if w.kind in args.kinds]
    dec_cfgs = DECODE_CONFIGS[:2] if args.tiny else DECODE_CONFIGS
    ext_cfgs = EXTEND_VARIANTS if args.variants else EXTEND_CONFIGS
    if args.tiny:
        ext_cfgs = [ExtendConfig(16, 16, 4, 1, c.pack_gqa) for c in ext_cfgs[:3]]
    rows = []
    first_out = {}

    def record(rb, setting: dict, **options):
        try:
            us, splits, out = measure(rb, **options)
            ref = first_out.setdefault(rb.workload.name, out.float())
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise ValueError(f"output differs from the first setting's by {err:.2e}")
            row = {"workload": rb.workload.name, **setting, "us": round(us, 1), "splits": splits}
            print(f"{rb.workload.name:<22} {json.dumps(setting):<70} {us:9.1f} us  {rate(rb, us):>14}  splits {splits}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile or run is reported
            row = {"workload": rb.workload.name, **setting, "error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{rb.workload.name:<22} {json.dumps(setting):<70} FAILED {row['error']}", flush=True)
            traceback.print_exc(file=sys.stdout)
        rows.append(row)
        return row

    for i, w in enumerate(workloads):
        rb = build_race_batch(w, device=device, seed=i)
        if w.kind == "decode":
            best = None
            for cfg in dec_cfgs:
                row = record(rb, {"block_n": cfg.block_n, "warps": cfg.num_warps, "stages": cfg.num_stages},
                             decode_config=cfg)
                if "us" in row and (best is None or row["us"] < best[0]):
                    best = (row["us"], cfg)
            if best is not None:
                for waves in WAVES[:2] if args.tiny else WAVES:
                    cfg = best[1]
                    record(rb, {"block_n": cfg.block_n, "warps": cfg.num_warps, "stages": cfg.num_stages,
                                "waves": waves}, decode_config=cfg, split_waves=waves)
        else:
            for cfg in ext_cfgs:
                record(rb, dataclasses.asdict(cfg), extend_config=cfg)
        del rb
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.best_extend:
        best = best_extend_config([r for r in rows if "block_m" in r])
        if best:
            with open(args.best_extend, "w") as f:
                json.dump({"extend_config": best}, f)
            print("best extend config:", json.dumps(best))
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
