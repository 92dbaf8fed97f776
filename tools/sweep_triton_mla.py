"""Sweep the MLA decode kernels and tiles (heads per program, key tile, warps, stages) and split settings on
the MLA workloads, and turn the winners into the shipped decode table.

Each setting is checked against the float32 oracle before it is timed (a tile that computes garbage fast
must not win). Writes JSON with every (workload, setting), the best per workload, and `tile_rules`: the
decode tile table rules the sweep implies (attention/kernels/mla/decode_table.py), printed at the end.

    PYTHONPATH=src python3 tools/sweep_triton_mla.py --out sweep-mla.json [--tiny] [--budget-s 150] [--decode-only]
    PYTHONPATH=src python3 tools/sweep_triton_mla.py --gluon-set SEESAW_WHOLE_TILES=1 --rounds 5 --out ab.json
        # the shipped tiles against themselves with the Gluon launch's switches set, alternating rounds
    python tools/sweep_triton_mla.py --apply sweep-mla.json   # no GPU: write its rules into the package

--apply replaces the rules of the sweep's architecture (sm90 for an H200) in mla/decode_table.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from attnserve.attention.kernels.gpu_target import GpuTarget
from attnserve.attention.kernels.mla.decode_table import (
    ROWS_64_KERNELS,
    MLADecodeConfig,
    rules_from_sweep,
    write_rules,
)
from attnserve.attention.kernels.mla.extend import MLAExtendConfig
from attnserve.bench.racers import attnserve_racer, build_race_batch
from attnserve.bench.timing import time_call
from attnserve.bench.workloads import MLA_WORKLOADS, TINY_WORKLOADS
from attnserve.reference.attention import reference_for_batch

ROOT = Path(__file__).resolve().parents[1]
# (block_h, block_n, num_warps, num_stages, defer_pv, split_waves, kernel); a workload's time share may end
# the list, so the Gluon kernels come first: the scorer (gluon/scorer.py) with float16 partials, the seesaw
# (gluon/seesaw.py) at 64+ heads, at one and half a wave of splits; the narrow one (gluon/narrow.py) at 16 heads,
# at half a wave (one split a request over many requests) and at one; then the Triton tiles.
DECODE_CONFIGS = [MLADecodeConfig(64, 64, 8, 2, False, v, "gluon_scorer", partials="float16") for v in (1, 0.5)] + [
    MLADecodeConfig(h, n, w, s, d, v, k) for h, n, w, s, d, v, k in (
    (64, 64, 8, 2, False, 1, "gluon_seesaw"), (64, 64, 8, 2, False, 0.5, "gluon_seesaw"),
    (16, 64, 8, 2, False, 0.5, "gluon_narrow"), (16, 64, 8, 2, False, 1, "gluon_narrow"),
    (64, 64, 8, 2, False, 1, "triton"), (16, 64, 8, 2, False, 1, "triton"), (16, 64, 4, 2, False, 1, "triton"))]
# extend: the shipped 32/32/4/2 first, then 32 rows on 8 warps (no spills, against 64 B at 4 warps), 64 rows on
# 8 warps with and without the deferred PV
EXTEND_CONFIGS = [MLAExtendConfig(m, n, w, s, d) for m, n, w, s, d in (
    (32, 32, 4, 2, False), (32, 32, 8, 2, False), (32, 64, 8, 2, False), (64, 32, 8, 2, True),
    (64, 32, 8, 2, False), (32, 64, 4, 2, False))]
TINY_CONFIGS = {"decode": [MLADecodeConfig(16, 16, 4, 1)], "extend": [MLAExtendConfig(16, 16, 4, 1)]}
# split settings on the default tiles (backend options): fewer splits write fewer float32 partials, more fill the
# GPU; a tile's own split_waves (above) is what the table can keep
SPLITS = ({"split_waves": 1.0}, {"split_waves": 4.0, "max_kv_splits": 128})


def settings_for(kind: str, tiny: bool, num_heads: int) -> list[tuple[dict, dict]]:
    """(the triton backend's options, what the row records) per setting of a workload kind; no decode head group
    wider than the heads (a 64-head group over 16 heads computes masked rows for nothing)."""
    key = "mla_decode_config" if kind == "decode" else "mla_extend_config"
    configs = TINY_CONFIGS[kind] if tiny else (DECODE_CONFIGS if kind == "decode" else EXTEND_CONFIGS)
    if kind == "decode":  # 16-head groups over 64+ heads: not raced there
        configs = [c for c in configs if c.for_heads(num_heads) == c and (num_heads < 64 or c.block_h >= 32)]
        # a 64-row tile over fewer heads computes masked rows: not raced there
        configs = [c for c in configs if c.kernel not in ROWS_64_KERNELS or num_heads >= 64]
    out = [({key: cfg}, {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}) for cfg in configs]
    if kind == "decode":
        out += [(dict(s), dict(s)) for s in (SPLITS[:1] if tiny else SPLITS)]
    return out


def measure(row: dict, w, rb, ref, device: str, options: dict, context=None) -> dict:
    """The triton backend with `options` (inside `context`, e.g. switches set) on the workload's batch: checked
    against the oracle, then on a GPU and within 1e-2 timed (decode in a CUDA graph); into `row`, which is printed
    and returned. A setting that fails to compile or run is recorded in the row, not raised."""
    try:
        with context or contextlib.nullcontext():
            fn = attnserve_racer("triton", rb, **options)
            out = fn()
            row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
            if device == "cuda" and row["rel_err"] < 1e-2:
                us, _ = time_call(fn, use_graph=w.kind == "decode")
                row["us"] = round(us, 1)
                row["tflops"] = round(w.mla_flops() / us / 1e6, 1)
    except Exception as exc:  # noqa: BLE001 - a setting that cannot compile or run here is recorded, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    rb.keep.clear()
    print(json.dumps(row), flush=True)
    return row


def device_for(tiny: bool) -> str:
    """The race's workloads run on the GPU; the tiny ones too where there is one (compiled), else on the CPU under
    TRITON_INTERPRET=1."""
    return "cuda" if not tiny or torch.cuda.is_available() else "cpu"


def sweep(args) -> dict:
    device = device_for(args.tiny)
    workloads = [w for w in TINY_WORKLOADS if w.mla] if args.tiny else MLA_WORKLOADS
    if args.decode_only:
        workloads = [w for w in workloads if w.kind == "decode"]
    started, rows = time.perf_counter(), []
    for i, w in enumerate(workloads):
        deadline = started + args.budget_s * (i + 1) / len(workloads)  # each workload gets its share
        rb = build_race_batch(w, device=device, seed=i)
        ref = reference_for_batch(rb.q, rb.layer, rb.fb, compute_dtype=torch.float32)
        for options, described in settings_for(w.kind, args.tiny, w.mla.num_heads):
            if time.perf_counter() > deadline:
                print(f"{w.name}: time share spent; next workload", flush=True)
                break
            row = {"workload": w.name, "heads": w.mla.num_heads, "page_size": w.page_size, **described}
            rows.append(measure(row, w, rb, ref, device, options))
    best = {}
    for r in rows:
        if "us" in r and (r["workload"] not in best or r["us"] < best[r["workload"]]["us"]):
            best[r["workload"]] = r
    shapes = {w.name: (w.mla.num_heads, w.page_size) for w in workloads if w.kind == "decode"}
    target = GpuTarget.of_device(device)
    return {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "arch": target.arch if target else None,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "torch": torch.__version__, "rows": rows, "best": best,
            "tile_rules": rules_from_sweep(rows, shapes)}


def race_switches(args) -> dict:
    """The shipped tiles (the backend's defaults) on each MLA workload (decode, and extend unless --decode-only),
    plain and with each --gluon-set, checked against the oracle and timed once a round, the order reversed every
    other round; the medians and each candidate's ratio to the plain one. For a schedule built behind a switch of
    the Gluon launch; the workloads it does not touch time the noise."""
    import statistics

    from attnserve.attention.kernels.mha.gluon_switches import MLA_DECODE, gluon_settings, parse_gluon_settings

    for sets in args.gluon_set:
        parse_gluon_settings(sets, MLA_DECODE)  # a misspelt switch stops here
    device = device_for(args.tiny)
    decode_only = getattr(args, "decode_only", False)
    workloads = [w for w in (TINY_WORKLOADS if args.tiny else MLA_WORKLOADS)
                 if w.mla and (w.kind == "decode" or not decode_only)]
    candidates = ["", *args.gluon_set]
    started, rows = time.perf_counter(), []
    batches = [build_race_batch(w, device=device, seed=i) for i, w in enumerate(workloads)]
    refs = [reference_for_batch(rb.q, rb.layer, rb.fb, compute_dtype=torch.float32) for rb in batches]
    for rnd in range(args.rounds):
        if time.perf_counter() - started > args.budget_s:
            print(f"budget spent before round {rnd + 1} of {args.rounds}", flush=True)
            break
        for sets in candidates if rnd % 2 == 0 else candidates[::-1]:
            for w, rb, ref in zip(workloads, batches, refs):
                row = {"workload": w.name, "switches": sets or "(shipped)", "round": rnd}
                rows.append(measure(row, w, rb, ref, device, {}, gluon_settings(sets, MLA_DECODE)))
    medians = {}
    for r in rows:
        if "us" in r:
            medians.setdefault(r["workload"], {}).setdefault(r["switches"], []).append(r["us"])
    medians = {w: {k: statistics.median(v) for k, v in ks.items()} for w, ks in medians.items()}
    for w, ks in medians.items():
        for k, us in ks.items():
            base = ks.get("(shipped)")
            vs = f"  {base / us:5.3f}x the shipped" if base and k != "(shipped)" else ""
            print(f"{w:<32} {k:<28} {us:9.1f} us (median){vs}", flush=True)
    return {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "torch": torch.__version__,
            "rows": rows, "medians": medians, "best": {}, "tile_rules": {}}


def apply(path: str) -> int:
    result = json.loads(Path(path).read_text())
    if not result.get("arch") or not result.get("tile_rules"):
        sys.exit(f"{path}: no architecture or no timed decode tiles to apply (a CPU or an empty sweep)")
    source = Path(path).resolve()
    results = ROOT / "benchmarks" / "results"  # a committed sweep is named within it
    source = source.relative_to(results).as_posix() if source.is_relative_to(results) else source.as_posix()
    written = write_rules(result["arch"], result["tile_rules"], source)
    print(f"wrote the {result['arch']} rules of {path} into {written}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="sweep-mla.json")
    p.add_argument("--tiny", action="store_true",
                   help="smoke run at tiny shapes: on the GPU where there is one, else on the CPU under "
                   "TRITON_INTERPRET=1")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new settings after this long")
    p.add_argument("--decode-only", action="store_true", help="leave out the extend workload")
    p.add_argument("--apply", metavar="SWEEP_JSON", help="write a finished sweep's tile rules into the package")
    p.add_argument("--gluon-set", action="append", default=[], metavar="NAME=VALUE[,...]",
                   help="race the shipped decode tiles with these switches of the Gluon MLA launch against the shipped "
                        "ones, round by round (repeatable; a candidate each)")
    p.add_argument("--rounds", type=int, default=5, help="with --gluon-set: rounds, the order reversed every other")
    args = p.parse_args()
    if args.apply:
        return apply(args.apply)
    result = race_switches(args) if args.gluon_set else sweep(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("best:", json.dumps(result["best"], indent=1))
    print("tile_rules (apply with --apply):", json.dumps(result["tile_rules"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
