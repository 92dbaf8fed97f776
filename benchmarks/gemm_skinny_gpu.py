"""The skinny GEMM candidate (attnserve.ops.kernels.skinny_gemm) against torch's F.linear (cuBLAS) at the
Llama-3-8B decode projections, M = 1 and 64 rows (--rows).

Per shape: cuBLAS, the candidate's default config, and a sweep of configs (columns per program, K step,
K split, warps, stages), each timed by attnserve.bench.timing (do_bench's median, L2 flushed before every
call) and checked against cuBLAS. Reported beside each time: the weights' bytes over the time, as a
fraction of the copy bandwidth measured in the same run. Last, a decode step's projections (32 layers of
qkv, o, gate|up and down, plus the LM head) summed for cuBLAS and for the best config per shape: what
issue 49's batch-1 and batch-64 rows would gain from wiring it in.

    python benchmarks/gemm_skinny_gpu.py --out gemm-skinny-h200.json           # on the GPU (a few minutes)
    python benchmarks/gemm_skinny_gpu.py --quick --out r.json                  # defaults only
    TRITON_INTERPRET=1 python benchmarks/gemm_skinny_gpu.py --tiny --out r.json  # the CPU check of the script
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

from attnserve.bench.timing import copy_bandwidth_tbps, time_call
from attnserve.ops.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_linear
from attnserve.versions import package_versions

# (name, N, K, times per decode step) for Llama-3-8B: 32 layers, hidden 4096, 32/8 heads of 128, MLP 14336
LLAMA3_8B = [("qkv", 6144, 4096, 32), ("o", 4096, 4096, 32), ("gate_up", 28672, 4096, 32),
             ("down", 4096, 14336, 32), ("lm_head", 128256, 4096, 1)]
TINY = [("qkv", 96, 64, 2), ("down", 64, 224, 2)]


def _time_ms(fn, device: str) -> float:
    """Median milliseconds a call (on the CPU the interpreter's: only to show the script runs)."""
    return time_call(fn, use_graph=False, device=device)[0] / 1000.0


def sweep_configs(m: int, n: int, k: int, programs_wanted: int, tiny: bool) -> list[SkinnyConfig]:
    base = default_config(m, n, k, programs_wanted)
    if tiny:
        return [base, SkinnyConfig(block_n=32, block_k=32, split_k=2)]
    splits = sorted({1, base.split_k, 2 * base.split_k})
    out = [base]
    grid = itertools.product((64, 128), (128, 256), splits, (4,), (3, 5))
    for block_n, block_k, split, warps, stages in grid:
        if k // (block_k * split) < 2:
            continue
        c = SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=warps, num_stages=stages)
        if c not in out:
            out.append(c)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,64", help="M values: issue 49's batch 1 and 64")
    ap.add_argument("--quick", action="store_true", help="the default config only, no sweep")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shapes = TINY if args.tiny else LLAMA3_8B
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 2
    t0 = time.time()
    what = ("tiny CPU check of the script (timings meaningless)" if args.tiny
            else "skinny GEMM candidate vs F.linear (cuBLAS), Llama-3-8B decode projections")
    result = {"what": what,
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": {**package_versions(), "python": platform.python_version()},
              "command": "python benchmarks/gemm_skinny_gpu.py " + " ".join(sys.argv[1:]),
              "copy_tb_s": copy_bandwidth_tbps() if device == "cuda" else None, "records": []}
    g = torch.Generator().manual_seed(0)
    for name, n, k, per_step in shapes:
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)  # [N, K]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, generator=g).to(device, dtype)  # [M, K]
            want = F.linear(x, w)
            rec = {"shape": name, "M": m, "N": n, "K": k, "per_step": per_step,
                   "weight_bytes": n * k * w.element_size(),
                   "cublas_ms": _time_ms(lambda x=x, w=w: F.linear(x, w), device), "configs": []}
            configs = [default_config(m, n, k, 2 * sms)]
            if not args.quick:
                configs = sweep_configs(m, n, k, 2 * sms, args.tiny)
            for c in configs:
                entry = {"config": c.__dict__}
                try:
                    err = (skinny_linear(x, w, c).float() - want.float()).abs().max().item()
                    ms = _time_ms(lambda x=x, w=w, c=c: skinny_linear(x, w, c), device)
                    entry.update(max_abs_err=err, ms=ms)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is recorded
                    entry["error"] = repr(exc)[:200]
                rec["configs"].append(entry)
            timed = [e for e in rec["configs"] if "ms" in e]
            if timed:
                best = min(timed, key=lambda e: e["ms"])
                rec["default_ms"] = rec["configs"][0].get("ms")
                rec["best"] = best
                rec["best_over_cublas"] = rec["cublas_ms"] / best["ms"]
                if result["copy_tb_s"]:
                    bw = result["copy_tb_s"] * 1e12
                    rec["cublas_of_copy_bw"] = rec["weight_bytes"] / (rec["cublas_ms"] * 1e-3) / bw
                    rec["best_of_copy_bw"] = rec["weight_bytes"] / (best["ms"] * 1e-3) / bw
            result["records"].append(rec)
            keys = ("shape", "M", "cublas_ms", "default_ms", "best_over_cublas", "cublas_of_copy_bw",
                    "best_of_copy_bw")
            print(json.dumps({key: rec.get(key) for key in keys}), flush=True)
            with open(args.out, "w") as f:  # every shape kept as it lands
                json.dump(result, f, indent=1)
    step = {}
    for m in sorted({r["M"] for r in result["records"]}):
        rows = [r for r in result["records"] if r["M"] == m and "best" in r]
        step[str(m)] = {"cublas_ms": sum(r["cublas_ms"] * r["per_step"] for r in rows),
                        "best_per_shape_ms": sum(min(r["cublas_ms"], r["best"]["ms"]) * r["per_step"]
                                                 for r in rows),
                        "skinny_only_ms": sum(r["best"]["ms"] * r["per_step"] for r in rows)}
    result["decode_step_projections"] = step
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(step, indent=1))
    print("wrote", args.out, f"in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
