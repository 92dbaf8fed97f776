"""`attnserve tune`: measure which attention backend is fastest for a model on this machine.

Races every backend that runs here on the model's own attention shape, checks each
against the oracle first, prints a table (time and % of roofline per backend and
workload) and writes the result to the user's cache, where `select`, `generate` and
`serve` find it and prefer its winner (unless --no-tuned). `--baseline OLD.json` then
compares with a stored run and exits 3 when anything slowed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from attnserve.bench.baseline import add_guard_arguments, check_comparable, load_run, report
from attnserve.bench.tune import run_tune
from attnserve.choice.selection import ServingFeatures
from attnserve.choice.tuned import RESULT_KIND, result_path, shape_key
from attnserve.commands.engine_args import add_engine_arguments
from attnserve.dtypes import resolve_dtypes
from attnserve.hardware import detect_hardware
from attnserve.models.config import ModelConfig, attention_shape_of, stated_dtype_of

DEFAULT_MODEL = "smollm2-135m"  # the shape of the embedded model `generate` and `serve` run without --model


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune", help="race the attention backends on a model's shapes here and remember the winner",
        description="Race every attention backend that runs on this machine on the model's own attention "
        "shapes (checked against the oracle first), print the times, and write the result to "
        "$ATTNSERVE_CACHE_DIR (default ~/.cache/attnserve/), where select/generate/serve prefer its winner.",
    )
    add_engine_arguments(p, only=("model", "tp_size", "kv_cache_dtype", "page_size"), overrides={
        "model": {"default": DEFAULT_MODEL,
                  "help": f"a preset, a HF config.json or model directory, or a .gguf file (default: {DEFAULT_MODEL}, "
                  "the embedded model's shape)"},
        "tp_size": {"help": "tensor-parallel size: the heads one rank sees"},
        "kv_cache_dtype": {"help": "auto (as the engine: the model dtype, which --dtype auto makes bf16 on a CPU "
                                   "with AMX or AVX512-BF16, fp32 on other CPUs, the checkpoint's on a GPU), bf16, "
                                   "fp16, fp32"},
        "page_size": {"help": "KV page size (default: 1, the engine's)"},
    })
    p.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                   help="race only these (default: every backend that runs here; on the CPU triton only "
                   "when named, under TRITON_INTERPRET=1)")
    p.add_argument("--quick", action="store_true", help="a smaller grid: two decode batches, one prefill")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    add_guard_arguments(p)
    return p


def _shape(model: str, tp_size: int):
    """(the per-rank AttentionShape, the model's longest context)."""
    cfg = ModelConfig.load(model)
    return attention_shape_of(cfg, tp_size, name=str(model)), cfg.max_position_embeddings


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory, so a reader never sees half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def print_table(result: dict, console) -> None:
    """One row per workload: each backend's time and % of roofline, and the fastest."""
    recs = result["records"]
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    table = Table(title=f"{result['model']} on {result['machine_detail']} ({result['shape']['kv_cache_dtype']}, "
                  f"page {result['shape']['page_size']}): us, % of roofline")
    table.add_column("workload")
    for b in backends:
        table.add_column(b, justify="right")
    table.add_column("fastest")
    for wname in dict.fromkeys(r["workload"] for r in recs):
        row = {r["backend"]: r for r in recs if r["workload"] == wname}
        timed = {b: r["us"] for b, r in row.items() if "us" in r}
        cells = []
        for b in backends:
            r = row.get(b)
            if r is None:
                cells.append("")
            elif "us" in r:
                pct = f" ({r['pct_of_ceiling']:.0f}%)" if "pct_of_ceiling" in r else ""
                cells.append(f"{r['us']:.1f}{pct}")
            else:
                cells.append("[red]failed check[/red]" if "failed_check" in r else "[yellow]skipped[/yellow]")
        table.add_row(wname, *cells, min(timed, key=timed.get) if timed else "-")
    console.print(table)
    for r in recs:
        if "failed_check" in r or "skipped" in r:
            console.print(f"  {r['workload']} / {r['backend']}: {r.get('failed_check') or r.get('skipped')}")
    for side, w in result["winners"].items():
        margin = f", {w['ratio']:.2f}x faster than {w['runner_up']}" if w.get("runner_up") else " (raced alone)"
        console.print(f"{side}: {w['backend']}{margin}")


def run(args) -> int:
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {args.tp_size}")
    hw = detect_hardware()
    model, max_context = _shape(args.model, args.tp_size)
    # "auto" as the engine resolves it here (attnserve.dtypes), so the engine finds what tune measured
    kv = resolve_dtypes(hw.device, hw.cpu_bf16, "auto", args.kv_cache_dtype, stated_dtype_of(args.model)).kv_cache
    serving = ServingFeatures(page_size=args.page_size, kv_cache_dtype=kv)
    baseline = load_run(args.baseline) if args.baseline is not None else None
    if baseline is not None:  # refuse an incomparable baseline before racing
        check_comparable({"kind": RESULT_KIND, "machine": hw.name,
                          "shape": shape_key(model, serving.kv_cache_dtype, serving.page_size or 1), "records": []},
                         baseline, str(args.baseline))
    path = result_path(hw.name, shape_key(model, serving.kv_cache_dtype, serving.page_size or 1))
    partial = path.with_name(path.name + ".partial")  # not tune-*.json: selection never reads it

    def checkpoint(records):  # a run cut short (a time limit) still leaves what it measured
        write_atomically(partial, json.dumps({"kind": "attnserve-tune-partial", "machine": hw.name,
                                              "model": str(args.model), "records": records}, indent=1) + "\n")

    # the table (or JSON) goes to stdout, the notes and the progress bar to stderr
    err = Console(stderr=True)
    result = run_tune(hw, model, serving, model_name=str(args.model), tp_size=args.tp_size, quick=args.quick,
                      wanted=args.backends, max_context=max_context, log=lambda m: err.print(m, soft_wrap=True),
                      progress_factory=lambda n: tqdm(total=n, desc="tune", unit="race", file=sys.stderr),
                      checkpoint=checkpoint)
    write_atomically(path, json.dumps(result, indent=1) + "\n")
    partial.unlink(missing_ok=True)
    out = Console(stderr=True) if args.json else Console()
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_table(result, out)
    out.print(f"wrote {path}" + ("" if result["winners"] else " (no backend passed every workload: nothing to prefer)"))
    if baseline is not None:
        return report(result, baseline, str(args.baseline), args.regression_threshold, console=out)
    return 0
