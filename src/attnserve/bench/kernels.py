"""`attnserve bench kernels`: race every attention backend available here on fixed workloads.

For each workload every contestant is built, run once and checked against the oracle
(or, where the oracle's dense scores would not fit, against a peer), then timed:
decode as CUDA-graph replays, prefill/extend eagerly with L2 flushed. The copy-bandwidth
and matmul ceilings are re-measured in the same run. Output: a table on stdout, a JSON
file and a PNG chart.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import traceback
from pathlib import Path

import torch

from attnserve.bench.baseline import add_guard_arguments, check_comparable, load_run, report
from attnserve.bench.oracle import oracle_output, rates, rel_err
from attnserve.bench.racers import build_race_batch, output_rows, racers_for
from attnserve.bench.timing import copy_bandwidth_tbps, matmul_tflops, time_call
from attnserve.bench.workloads import MLA_WORKLOADS, TINY_WORKLOADS, WORKLOADS, Workload, select
from attnserve.versions import package_versions

PEER_FOR_RATIO = {"decode": "flashinfer", "prefill": "flashinfer-fa3", "extend": "flashinfer-fa3",
                  "mla": "flashinfer-mla-fa3"}
YARDSTICKS = ("sdpa-flash", "flashinfer-fa3", "flashinfer-fa2")  # peers to check against without an oracle


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", nargs="*", help="run only workloads whose name contains one of these "
                   "(MLA workloads only when one mentions mla, e.g. --workloads mla)")
    p.add_argument("--backends", nargs="*", help="contestants to race (default: all available); names as "
                   "printed, a trailing * takes a family, e.g. triton 'sdpa*' torch_native flashinfer flashinfer-fa3")
    p.add_argument("--triton-options", default=None,
                   help='JSON options for the triton backend, e.g. \'{"extend_config": {"block_m": 128}}\'')
    p.add_argument("--json", type=Path, default=Path("kernels.json"), help="where to write the results")
    p.add_argument("--png", type=Path, default=None, help="chart path (default: the JSON path with .png)")
    p.add_argument("--tiny", action="store_true",
                   help="scaled-down shapes (smoke test; CPU under TRITON_INTERPRET=1; Triton 3.6's interpreter needs "
                        "numpy < 2.3 for it, or the tests' conftest.py, which tests/test_triton_bench.py runs it under)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check before timing")
    add_guard_arguments(p)


def _versions() -> dict:
    return {**package_versions(), "python": sys.version.split()[0]}


def _check_outputs(rb, records: list[dict], outputs: dict) -> None:
    """Relative error of every output against the oracle, or against a peer where the oracle is too big."""
    ref, ref_name = oracle_output(rb), "oracle"
    if ref is None:
        ref_name = next((n for n in YARDSTICKS if n in outputs), next(iter(outputs), None))
        ref = outputs.get(ref_name)
    if ref is None:
        return
    for rec in records:
        if rec["backend"] in outputs and rec["backend"] != ref_name:
            rec["rel_err"] = rel_err(outputs[rec["backend"]], ref)
            rec["checked_against"] = ref_name


# FlashInfer last (its JIT builds take minutes), the peers the ratios use first among its kernels
CONTESTANT_ORDER = ("triton", "sdpa-cudnn", "sdpa-flash", "torch_native", "flashinfer", "flashinfer-fa3",
                    "flashinfer-cuda-cores", "flashinfer-fa2", "flashinfer-mla-fa3", "flashinfer-mla-fa2")


def _order(name: str) -> int:
    return CONTESTANT_ORDER.index(name) if name in CONTESTANT_ORDER else len(CONTESTANT_ORDER)


def triton_options(text: str | None) -> dict:
    """--triton-options JSON -> TritonBackend options (config dicts become config objects).

    The one place the race imports the Triton kernel modules, which need triton (an optional package)."""
    if not text:
        return {}
    from attnserve.attention.kernels.mha.configs import DecodeConfig
    from attnserve.attention.kernels.mha.extend import ExtendConfig
    from attnserve.attention.kernels.mla.decode_table import MLADecodeConfig
    from attnserve.attention.kernels.mla.extend import MLAExtendConfig
    from attnserve.attention.kernels.mha.prefill_tma import PrefillTmaConfig

    opts = json.loads(text)
    for key, cls in (("decode_config", DecodeConfig), ("extend_config", ExtendConfig),
                     ("mla_decode_config", MLADecodeConfig), ("mla_extend_config", MLAExtendConfig),
                     ("prefill_tma_config", PrefillTmaConfig)):
        if key in opts:
            opts[key] = cls(**opts[key])
    return opts


def race(workloads: list[Workload], wanted, device: str, check: bool, ceilings: dict, log=print,
         options: dict | None = None, progress=None) -> list[dict]:
    """Every contestant over every workload, contestant by contestant (all batches stay resident)."""
    batches = [build_race_batch(w, device=device, seed=i) for i, w in enumerate(workloads)]
    fields = [racers_for(rb, wanted, options) for rb in batches]
    names = sorted({n for f in fields for n in f}, key=lambda n: (_order(n), n))
    done: list[dict] = []
    records = {(w.name, n): None for w, f in zip(workloads, fields) for n in f}
    outputs: dict[str, dict] = {w.name: {} for w in workloads}
    for name in names:
        for w, rb, field_ in zip(workloads, batches, fields):
            if name not in field_:
                continue
            rec = {"workload": w.name, "backend": name}
            try:
                fn = field_[name]()
                out = output_rows(fn(), rb)  # also compiles / JIT-builds outside the timing
                path = getattr(getattr(fn, "backend", None), "extend_path", None)
                if path and w.kind != "decode":
                    rec["kernel_path"] = path  # which of the backend's kernels ran (triton: TMA or paged)
                if check:
                    outputs[w.name][name] = out
                if device == "cuda":
                    us, method = time_call(fn, use_graph=w.kind == "decode")
                    rec.update(us=round(us, 1), timing=method, **rates(w, us, rb, ceilings))
            except Exception as exc:  # noqa: BLE001 - a contestant that cannot run here is reported, not fatal
                rec["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                if "--debug" in sys.argv:
                    traceback.print_exc()
            records[(w.name, name)] = rec
            done.append(rec)
            if progress is not None:
                progress(done)
            rb.keep.clear()
            gc.collect()
            log(_format(rec))
    ordered = []
    for w, rb in zip(workloads, batches):
        recs = [records[(w.name, n)] for n in names if (w.name, n) in records]
        if check:
            _check_outputs(rb, recs, outputs[w.name])
        _add_ratios(recs, "mla" if w.mla is not None else w.kind)
        ordered += recs
    return ordered


def _add_ratios(records: list[dict], kind: str) -> None:
    peer = next((r for r in records if r["backend"] == PEER_FOR_RATIO[kind] and "us" in r), None)
    if peer is None and kind != "decode":
        fallback = "flashinfer-mla-fa2" if kind == "mla" else "flashinfer-fa2"
        peer = next((r for r in records if r["backend"] == fallback and "us" in r), None)
    if peer is None:
        return
    for r in records:
        if "us" in r:
            r["vs_flashinfer"] = round(peer["us"] / r["us"], 3)  # > 1: faster than FlashInfer
            r["flashinfer_peer"] = peer["backend"]


def _format(r: dict) -> str:
    if "skipped" in r:
        return f"  {r['workload']:<22} {r['backend']:<22} skipped ({r['skipped']})"
    rate = f"{r['tbps']:.2f} TB/s" if "tbps" in r else (f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else "")
    pct = f"{r['pct_of_ceiling']:.0f}% of ceiling" if "pct_of_ceiling" in r else ""
    err = f"err {r['rel_err']:.1e} vs {r['checked_against']}" if "rel_err" in r else ""
    us = f"{r['us']:.1f} us" if "us" in r else ""
    path = f" [{r['kernel_path']}]" if "kernel_path" in r else ""
    return f"  {r['workload']:<22} {r['backend']:<22} {us:>10} {rate:>14} {pct:>17} {err}{path}"


def summary_lines(records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        if r.get("backend") == "triton" and "vs_flashinfer" in r:
            path = f" [{r['kernel_path']}]" if "kernel_path" in r else ""
            lines.append(f"{r['workload']:<22} triton / {r['flashinfer_peer']}: {r['vs_flashinfer']:.2f}x{path}")
    return lines


def write_chart(result: dict, path: Path) -> None:
    """Two panels: decode TB/s and prefill/extend TFLOP/s per backend, ceilings as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"] if "us" in r]
    panels = [("decode", "tbps", "TB/s", result["ceilings"].get("copy_tbps")),
              ("prefill/extend", "tflops", "TFLOP/s", result["ceilings"].get("matmul_tflops"))]
    fig, axes = plt.subplots(1, 2, figsize=(16, 6))
    for ax, (title, key, unit, ceiling) in zip(axes, panels):
        rows = [r for r in recs if key in r]
        workloads = list(dict.fromkeys(r["workload"] for r in rows))
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        width = 0.8 / max(1, len(backends))
        for i, b in enumerate(backends):
            xs, ys = [], []
            for j, wname in enumerate(workloads):
                hit = [r[key] for r in rows if r["workload"] == wname and r["backend"] == b]
                if hit:
                    xs.append(j + i * width - 0.4 + width / 2)
                    ys.append(hit[0])
            ax.bar(xs, ys, width, label=b)
        if ceiling:
            ax.axhline(ceiling, ls="--", color="grey", lw=1)
            ax.text(len(workloads) - 0.5, ceiling, f"ceiling {ceiling:.3g}", ha="right", va="bottom", fontsize=8)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"{title} ({result['gpu']})")
        if backends:
            ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gpu_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"


def run_bench(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if getattr(args, "baseline", None) is not None:  # another GPU's baseline is refused before spending GPU time
        check_comparable({"gpu": _gpu_name(device), "records": []}, load_run(args.baseline), str(args.baseline))

    if device == "cpu" and not args.tiny:
        raise ValueError("bench kernels needs a CUDA GPU (use --tiny for a CPU smoke run under TRITON_INTERPRET=1)")
    workloads = select(args.workloads, TINY_WORKLOADS if args.tiny else WORKLOADS + MLA_WORKLOADS)
    ceilings = {}
    if device == "cuda":
        ceilings = {"copy_tbps": round(copy_bandwidth_tbps(), 3), "matmul_tflops": round(matmul_tflops(), 1)}
        print(f"ceilings: copy {ceilings['copy_tbps']:.2f} TB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    options = triton_options(args.triton_options)
    gpu = _gpu_name(device)
    partial = args.json.with_suffix(".partial.json")

    def progress(done):  # a run cut short still leaves what it measured
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"gpu": gpu, "ceilings": ceilings, "records": done}, indent=1))

    records = race(workloads, args.backends, device, not args.no_check, ceilings, options=options,
                   progress=progress)
    partial.unlink(missing_ok=True)
    print("results:")
    for r in records:
        print(_format(r))
    result = {
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "versions": _versions(),
        "shapes": {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16",
                   "mla": "kv_lora_rank 512 + rope 64, heads as named, softmax scale 192^-1/2"},
        "ceilings": ceilings,
        "triton_options": json.loads(args.triton_options) if args.triton_options else {},
        "records": records,
    }
    return result


def run(args) -> int:
    result = run_bench(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    png = args.png or args.json.with_suffix(".png")
    write_chart(result, png)
    print("\n".join(summary_lines(result["records"])))
    print(f"wrote {args.json} and {png}")
    if args.baseline is not None:
        return report(result, load_run(args.baseline), str(args.baseline), args.regression_threshold)
    return 0
