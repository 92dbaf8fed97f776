"""`attnserve bench kernels`: race every attention backend available here on fixed workloads.

For each workload every contestant is built, run once and checked against the oracle
(or, where the oracle's dense scores would not fit, against a peer), then timed:
decode as CUDA-graph replays, prefill/extend eagerly, L2 cold before every call in both
(bench/timing.py). The copy-bandwidth and matmul ceilings are re-measured in the same run.
With `--runs N` the whole race runs N times, the contestants' order reversed every other run,
and each ratio is reported with its range over runs (bench/protocol.py). `--peer-site DIR`
races the peers again from another install (e.g. a newer FlashInfer, which cannot load next to
the one installed here) in a child process and merges its rows, labelled `name@version`.
Output: a table on stdout, a JSON file and a PNG chart.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from attnserve.bench.baseline import add_guard_arguments, check_comparable, load_run, report
from attnserve.bench.oracle import oracle_output, rates, rel_err
from attnserve.bench.protocol import (
    add_ratios,
    combine_runs,
    format_ratio,
    is_peer,
    label_peer_records,
    merge_peer_records,
    peer_label,
    run_order,
)
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
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="race the whole field N times, the order reversed every other run; times are the median, "
                        "ratios come with their range over runs (default 1)")
    p.add_argument("--only-peers", action="store_true", help="race only the peers, not attnserve's own kernels")
    p.add_argument("--peer-site", action="append", type=Path, default=[], metavar="DIR",
                   help="also race the peers (--peer-backends) installed in DIR, in a child process with DIR first "
                        "on PYTHONPATH; their rows are labelled name@version (repeatable)")
    p.add_argument("--peer-backends", nargs="*", default=["flashinfer*"],
                   help="contestants the --peer-site children race (default: every FlashInfer kernel)")
    p.add_argument("--no-png", action="store_true", help="write no chart")
    add_guard_arguments(p)


# distributions of the peers whose version a race records beside package_versions()'
PEER_DISTRIBUTIONS = ("flashinfer-python", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels")


def _versions() -> dict:
    """Every contestant's version: torch, triton, FlashInfer, FA4 and its CuTe DSL, cuDNN (through torch)."""
    out = {**package_versions(), "python": sys.version.split()[0]}
    for dist in PEER_DISTRIBUTIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        import triton

        out.setdefault("triton", triton.__version__)
    except ImportError:
        pass
    if torch.backends.cudnn.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
    return out


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
CONTESTANT_ORDER = ("triton", "sdpa-cudnn", "sdpa-flash", "fa4", "torch_native", "flashinfer", "flashinfer-fa3",
                    "flashinfer-cuda-cores", "flashinfer-fa2", "flashinfer-mla-fa3", "flashinfer-mla-fa2")


def _order(name: str) -> int:
    return CONTESTANT_ORDER.index(name) if name in CONTESTANT_ORDER else len(CONTESTANT_ORDER)


def triton_options(text: str | None) -> dict:
    """--triton-options JSON -> the triton backend's options (config dicts become config objects).

    The one place the race imports the Triton kernel modules, which need triton (an optional package)."""
    if not text:
        return {}
    from attnserve.attention.kernels.mha.configs import DecodeConfig
    from attnserve.attention.kernels.mha.extend import ExtendConfig
    from attnserve.attention.kernels.mha.prefill_tma import PrefillTmaConfig
    from attnserve.attention.kernels.mla.decode_table import MLADecodeConfig
    from attnserve.attention.kernels.mla.extend import MLAExtendConfig

    opts = json.loads(text)
    for key, cls in (("decode_config", DecodeConfig), ("extend_config", ExtendConfig),
                     ("mla_decode_config", MLADecodeConfig), ("mla_extend_config", MLAExtendConfig),
                     ("prefill_tma_config", PrefillTmaConfig)):
        if key in opts:
            opts[key] = cls(**opts[key])
    return opts


def race(workloads: list[Workload], wanted, device: str, check: bool, ceilings: dict, log=print,
         options: dict | None = None, progress=None, run_index: int = 0, only_peers: bool = False) -> list[dict]:
    """Every contestant over every workload, contestant by contestant (all batches stay resident), in the
    order of run `run_index` (protocol.run_order); ratios are added once the runs are combined."""
    batches = [build_race_batch(w, device=device, seed=i) for i, w in enumerate(workloads)]
    fields = [racers_for(rb, wanted, options) for rb in batches]
    if only_peers:
        fields = [{n: f for n, f in field_.items() if is_peer(n)} for field_ in fields]
    names = run_order(sorted({n for f in fields for n in f}, key=lambda n: (_order(n), n)), run_index)
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
                path = getattr(getattr(fn, "step", None), "extend_path", None)
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
        ordered += recs
    return ordered


def _kind(w: Workload) -> str:
    return "mla" if w.mla is not None else w.kind


def add_all_ratios(records: list[dict], kinds: dict[str, str]) -> None:
    """Per workload: `vs_flashinfer` against the FlashInfer kernel the README quotes (its fa2 where fa3 did not
    run) and `vs_best_peer` against the fastest peer, each with its range over runs (protocol.add_ratios)."""
    by_workload: dict[str, list[dict]] = {}
    for r in records:
        by_workload.setdefault(r["workload"], []).append(r)
    for name, recs in by_workload.items():
        kind = kinds.get(name, "prefill")
        timed = {r["backend"] for r in recs if "us" in r}
        peer = PEER_FOR_RATIO[kind]
        if peer not in timed and kind != "decode":
            peer = "flashinfer-mla-fa2" if kind == "mla" else "flashinfer-fa2"
        add_ratios(recs, peer if peer in timed else None)


def _format(r: dict) -> str:
    if "skipped" in r:
        return f"  {r['workload']:<22} {r['backend']:<22} skipped ({r['skipped']})"
    rate = f"{r['tbps']:.2f} TB/s" if "tbps" in r else (f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else "")
    pct = f"{r['pct_of_ceiling']:.0f}% of ceiling" if "pct_of_ceiling" in r else ""
    err = f"err {r['rel_err']:.1e} vs {r['checked_against']}" if "rel_err" in r else ""
    us = f"{r['us']:.1f} us" if "us" in r else ""
    path = f" [{r['kernel_path']}]" if "kernel_path" in r else ""
    runs = [t for t in r.get("us_runs") or () if t]
    spread = f" runs {min(runs):.1f}-{max(runs):.1f}" if len(runs) > 1 else ""
    ratio = (f" {format_ratio(r['vs_best_peer'], r.get('vs_best_peer_range'))} vs {r['best_peer']}"
             if "vs_best_peer" in r else "")
    return f"  {r['workload']:<22} {r['backend']:<26} {us:>10} {rate:>14} {pct:>17} {err}{path}{spread}{ratio}"


def summary_lines(records: list[dict]) -> list[str]:
    """triton against the FlashInfer kernel the README quotes and against the best peer, with ranges over runs."""
    lines = []
    for r in records:
        if r.get("backend") != "triton" or not ("vs_flashinfer" in r or "vs_best_peer" in r):
            continue
        path = f" [{r['kernel_path']}]" if "kernel_path" in r else ""
        parts = []
        if "vs_flashinfer" in r:
            parts.append(f"triton / {r['flashinfer_peer']}: {format_ratio(r['vs_flashinfer'], r.get('vs_flashinfer_range'))}")
        if "vs_best_peer" in r:
            parts.append(f"best peer {r['best_peer']}: {format_ratio(r['vs_best_peer'], r.get('vs_best_peer_range'))}")
        lines.append(f"{r['workload']:<22} " + "; ".join(parts) + path)
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
            xs, ys, lo, hi = [], [], [], []
            for j, wname in enumerate(workloads):
                hit = [r for r in rows if r["workload"] == wname and r["backend"] == b]
                if hit:
                    xs.append(j + i * width - 0.4 + width / 2)
                    ys.append(hit[0][key])
                    a, c = _rate_span(hit[0], key)
                    # rounded rates and times can put the median a hair outside its runs' span
                    lo.append(max(hit[0][key] - a, 0.0))
                    hi.append(max(c - hit[0][key], 0.0))
            ax.bar(xs, ys, width, label=b, yerr=[lo, hi] if any(lo) or any(hi) else None, capsize=2)
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


def _rate_span(rec: dict, key: str) -> tuple[float, float]:
    """The rate's (lowest, highest) over runs: rates scale with 1 / time."""
    runs = [t for t in rec.get("us_runs") or () if t]
    if len(runs) < 2:
        return rec[key], rec[key]
    return rec[key] * rec["us"] / max(runs), rec[key] * rec["us"] / min(runs)


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

    nruns = max(1, args.runs)
    runs = []
    for i in range(nruns):
        if nruns > 1:
            print(f"run {i + 1} of {nruns}" + (" (order reversed)" if i % 2 else ""))
        runs.append(race(workloads, args.backends, device, not args.no_check and i == 0, ceilings, options=options,
                         progress=progress, run_index=i, only_peers=args.only_peers))
    records = combine_runs(runs)
    peer_runs = []
    for site in args.peer_site:
        extra, info = race_peer_site(site, args, nruns)
        peer_runs.append(info)
        records = merge_peer_records(records, extra)
    add_all_ratios(records, {w.name: _kind(w) for w in workloads})
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
        "runs": nruns,
        "protocol": ("L2 cold before every timed call (do_bench's flush eagerly; a flush inside the graph for "
                     "decode, its own time subtracted); contestants' order reversed every other run; us = median "
                     "over runs, us_runs each run's, *_range = [min, max] over runs of the same run's ratio"),
        "peer_runs": peer_runs,
        "records": records,
    }
    return result


def child_command(args, nruns: int, out: Path) -> list[str]:
    """The `bench kernels` a --peer-site child runs: the peers only, the same workloads and runs, no chart."""
    cmd = [sys.executable, "-m", "attnserve", "bench", "kernels", "--only-peers", "--runs", str(nruns),
           "--json", str(out), "--no-png"]
    if args.workloads:
        cmd += ["--workloads", *args.workloads]
    if args.peer_backends:
        cmd += ["--backends", *args.peer_backends]
    if args.tiny:
        cmd.append("--tiny")
    if args.no_check:
        cmd.append("--no-check")
    return cmd


def child_env(site: Path, environ: dict | None = None) -> dict:
    """The child's environment: `site` first on PYTHONPATH, then this attnserve, then what was there."""
    env = dict(os.environ if environ is None else environ)
    here = str(Path(__file__).resolve().parents[2])  # the directory holding the attnserve package
    env["PYTHONPATH"] = os.pathsep.join([str(site), here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def race_peer_site(site: Path, args, nruns: int) -> tuple[list[dict], dict]:
    """Race the peers installed in `site` in a child process; (its rows labelled name@version, what it was)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peers.json"
        cmd = child_command(args, nruns, out)
        print(f"peers from {site}: {' '.join(cmd[1:])}")
        done = subprocess.run(cmd, env=child_env(site), check=False)
        if done.returncode != 0 or not out.is_file():
            return [], {"site": str(site), "error": f"child exited {done.returncode}"}
        child = json.loads(out.read_text())
    label = peer_label(child.get("versions", {}))
    return (label_peer_records(child["records"], label, str(site)),
            {"site": str(site), "label": label, "versions": child.get("versions", {})})


def run(args) -> int:
    result = run_bench(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    png = None if args.no_png else args.png or args.json.with_suffix(".png")
    if png is not None:
        write_chart(result, png)
    print("\n".join(summary_lines(result["records"])))
    print(f"wrote {args.json}" + (f" and {png}" if png is not None else ""))
    if args.baseline is not None:
        return report(result, load_run(args.baseline), str(args.baseline), args.regression_threshold)
    return 0
