"""What bounds an attention kernel: Nsight Compute on every launch of one call of each contestant at one race workload.

For every contestant (MHA prefill and extend: triton, fa4, flashinfer-fa3, and sdpa-cudnn on fresh prompts; MLA
decode and extend: triton, flashinfer-mla-fa3) a child process builds the race's batch, calls the racer once to
compile and warm it, then once more between cudaProfilerStart and cudaProfilerStop: ncu (`--profile-from-start
off`) profiles every kernel of that second call, so a split-KV decode's merge or the extend's gather of its keys
counts with the attention kernel. Clocks are left alone (`--clock-control none`) and caches flushed between
replays. Kept per kernel: duration, the tensor (wgmma), MUFU (exp2), FMA and ALU pipes' share of their peak, issue
slots busy, and the six largest warp stall reasons (ncu's issue_stalled_*.ratio metrics), so "the softmax is not
hidden under the MMAs" (MUFU and ALU busy, tensor pipe idle) reads as numbers. The record's headline is the
longest kernel's; `us_total` sums the call's kernels.

    python benchmarks/prefill_ncu.py --workload "prefill 1x16384" --out prefill-ncu.json [--contestants triton fa4]
    python benchmarks/prefill_ncu.py --workload "mla decode 128x4096 h128 p1" --out mla-ncu.json
    python benchmarks/prefill_ncu.py --workload "prefill 8x2048" --contestants triton --gluon-set STAGES=3

Without ncu on PATH it writes the record with `ncu_error` and exits 1; `--child` is the profiled process.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import time

# each workload kind's default contestants (a contestant the workload has no racer for is recorded as absent)
MHA_CONTESTANTS = ["triton", "fa4", "flashinfer-fa3", "sdpa-cudnn"]
MLA_CONTESTANTS = ["triton", "flashinfer-mla-fa3"]
# pipes' cycles active as % of peak (tensor = wgmma on sm90; xu = MUFU: exp2, rcp), issue slots, stall reasons
METRICS = [
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "regex:sm__pipe_(tensor_op_gmma|tensor_op_hmma|xu|fma|alu|fmaheavy|shared)_cycles_active.avg.pct_of_peak_sustained_active",
    "regex:sm__inst_executed_pipe_(xu|fma|alu|tensor_op_gmma).sum",
    "regex:smsp__average_warp_latency_issue_stalled_.*.ratio",
    "dram__bytes_read.sum",
    "launch__registers_per_thread",
    "launch__grid_size",
]


def find_workload(name: str):
    from attnserve.bench.workloads import MLA_WORKLOADS, TINY_WORKLOADS, WORKLOADS

    for w in WORKLOADS + MLA_WORKLOADS + TINY_WORKLOADS:
        if w.name == name:
            return w
    raise SystemExit(f"no race workload named {name!r}")


def child(workload: str, contestant: str, gluon_set: str) -> None:
    import torch

    from attnserve.attention.kernels.mha.gluon_switches import gluon_settings
    from attnserve.bench.racers import build_race_batch, racers_for

    rb = build_race_batch(find_workload(workload), device="cuda" if torch.cuda.is_available() else "cpu")
    racers = racers_for(rb, [contestant])
    if contestant not in racers:
        raise SystemExit(f"{contestant} has no racer for {workload}")
    with gluon_settings(gluon_set):  # the switches are read when the kernel is built, at the first call
        fn = racers[contestant]()
        out = fn()  # compiles and warms, outside the profiled range
        if rb.q.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()  # ncu --profile-from-start off: only this call's kernels
        out = fn()
        if rb.q.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    print(f"{contestant}: {tuple(out.shape)}")


def parse_raw_csv(text: str) -> list[dict]:
    """ncu --csv --page raw: a header row, a units row, one row per profiled kernel -> each kernel's metrics."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if len(lines) < 3:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header = rows[0]
    kernels = []
    for values in rows[2:]:
        out: dict = {}
        for name, value in zip(header, values):
            try:
                out[name] = float(value.replace(",", ""))
            except ValueError:
                out[name] = value
        kernels.append(out)
    return kernels


def summarise(raw: dict) -> dict:
    pipes = {k.split("__pipe_")[1].split("_cycles")[0]: v for k, v in raw.items()
             if "__pipe_" in k and k.endswith("pct_of_peak_sustained_active") and isinstance(v, float)}
    stalls = {k.split("issue_stalled_")[1].removesuffix(".ratio"): v for k, v in raw.items()
              if "issue_stalled_" in k and isinstance(v, float)}
    top = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
    return {"kernel": raw.get("Kernel Name"), "us": round(raw.get("gpu__time_duration.sum", 0) / 1e3, 1),
            "pipes_pct_of_peak": {k: round(v, 1) for k, v in sorted(pipes.items())},
            "issue_slots_busy_pct": raw.get("sm__inst_issued.avg.pct_of_peak_sustained_active"),
            "sm_throughput_pct": raw.get("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
            "top_stalls": {k: round(v, 2) for k, v in top.items()},  # ncu's issue_stalled_*.ratio as it reports them
            "registers": raw.get("launch__registers_per_thread"), "grid": raw.get("launch__grid_size"),
            "dram_read_mb": round(raw.get("dram__bytes_read.sum", 0) / 1e6, 1),
            "inst_executed": {k.split("pipe_")[1].removesuffix(".sum"): v for k, v in raw.items()
                              if k.startswith("sm__inst_executed_pipe_") and k.endswith(".sum")}}


def profile_record(kernels: list[dict]) -> dict:
    """The longest kernel's summary as the headline, every kernel's name and time, and their sum."""
    summaries = [summarise(k) for k in kernels]
    head = max(summaries, key=lambda s: s["us"])
    return head | {"us_total": round(sum(s["us"] for s in summaries), 1),
                   "kernels": [{"kernel": s["kernel"], "us": s["us"]} for s in summaries], "raw": kernels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="prefill 1x16384")
    p.add_argument("--contestants", nargs="*", default=None,
                   help=f"default: {' '.join(MHA_CONTESTANTS)} (MLA workloads: {' '.join(MLA_CONTESTANTS)})")
    p.add_argument("--out", default="prefill-ncu.json")
    p.add_argument("--timeout-s", type=float, default=240, help="per contestant")
    p.add_argument("--gluon-set", default="", metavar="NAME=VALUE[,NAME=VALUE]",
                   help="the Gluon prefill's module switches while triton runs (e.g. STAGES=3)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.workload, args.child, args.gluon_set)
        return 0
    import torch

    from attnserve.attention.kernels.mha.gluon_switches import parse_gluon_settings
    from attnserve.versions import package_versions

    parse_gluon_settings(args.gluon_set)  # a misspelt switch stops here, before any profile
    ncu = shutil.which("ncu")
    result = {"workload": args.workload, "gluon_set": args.gluon_set,
              "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "versions": package_versions(), "metrics": METRICS, "profiles": {}}

    def save():  # after every contestant, so a cut run keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if not ncu:
        result["ncu_error"] = "ncu is not on PATH"
        save()
        print(result["ncu_error"])
        return 1
    w = find_workload(args.workload)
    # SDPA races fresh prompts only (no cached prefix)
    contestants = args.contestants or (MLA_CONTESTANTS if w.mla else
                                       [c for c in MHA_CONTESTANTS if not (w.prefix and c.startswith("sdpa"))])
    for name in contestants:
        cmd = [ncu, "--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off",
               "--csv", "--page", "raw",
               "--metrics", ",".join(METRICS), sys.executable, __file__, "--child", name, "--workload", args.workload,
               "--gluon-set", args.gluon_set]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, check=False)
            kernels = parse_raw_csv(proc.stdout)
            rec = profile_record(kernels) if kernels else {"error": (proc.stdout[-800:] + proc.stderr[-800:])}
        except subprocess.TimeoutExpired:
            rec = {"error": f"timeout after {args.timeout_s} s"}
        result["profiles"][name] = rec
        save()
        print(name, json.dumps({k: v for k, v in rec.items() if k != "raw"})[:900], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
