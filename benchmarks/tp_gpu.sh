#!/usr/bin/env bash
# tp 1 on one GPU through the tensor-parallel code path against the plain engine: nothing may slow down.
# Runs engine_gpu_decode.py (Llama-3-8B shape, random bf16 weights, 64 requests x 1024 in / 256 out, CUDA
# graphs, Triton attention) twice, in both orders, with "triton-graphs" (no torch.distributed world) and
# "triton-graphs-tp1-world" (a one-rank NCCL world: step broadcast, all-reduces and the logits all-gather
# all run), then writes benchmarks/results/tp_gpu_tp1.json: GPU, versions, date, decode step medians,
# the world/plain ratio, host syncs while launching, and whether both produced the same tokens.
# About 3 minutes on an H200 (overlap scheduling on, the default).
#   benchmarks/tp_gpu.sh            (from the repository root)
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout 130 python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256 --configs triton-graphs,triton-graphs-tp1-world \
  --out "$OUT/tp_gpu_run1.json" > "$OUT/tp_gpu_run1.log" 2>&1; echo "run 1 rc=$?"
timeout 130 python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256 --configs triton-graphs-tp1-world,triton-graphs \
  --out "$OUT/tp_gpu_run2.json" > "$OUT/tp_gpu_run2.log" 2>&1; echo "run 2 rc=$?"
python3 - "$OUT" <<'PY'
import json, sys
from datetime import datetime, timezone
out = sys.argv[1]
runs = [json.load(open(f"{out}/tp_gpu_run{i}.json")) for i in (1, 2)]
rows = {}
for run in runs:
    for r in run["results"]:
        rows.setdefault(r["label"], []).append(r)
def med(label, key):
    vals = sorted(r[key] for r in rows.get(label, []) if r.get(key) is not None)
    return vals[len(vals) // 2] if vals else None
plain, world = "triton-graphs", "triton-graphs-tp1-world"
summary = {
    "what": "tp 1 through the tensor-parallel path (one-rank NCCL world) vs the plain engine; " + runs[0]["what"],
    "gpu": runs[0]["gpu"], "versions": runs[0]["versions"], "date": datetime.now(timezone.utc).isoformat(),
    "decode_step_ms_median": {plain: [r["decode_step_ms_median"] for r in rows.get(plain, [])],
                              world: [r["decode_step_ms_median"] for r in rows.get(world, [])]},
    "output_tok_per_s": {plain: [r["output_tok_per_s"] for r in rows.get(plain, [])],
                         world: [r["output_tok_per_s"] for r in rows.get(world, [])]},
    "world_over_plain_decode_step": (round(med(world, "decode_step_ms_median") / med(plain, "decode_step_ms_median"), 3)
                                     if med(plain, "decode_step_ms_median") and med(world, "decode_step_ms_median") else None),
    "same_outputs": len({r["outputs_sha256_16"] for rs in rows.values() for r in rs}) == 1,
    "sync_calls_launching_12_warmup_steps": {k: [r.get("sync_calls_launching_12_warmup_steps") for r in rs]
                                             for k, rs in rows.items()},
    "pages_leaked": sorted({r["pages_leaked"] for rs in rows.values() for r in rs}),
    "errors": [run.get("errors") for run in runs],
}
json.dump(summary, open(f"{out}/tp_gpu_tp1.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
