#!/usr/bin/env bash
# One H200 call that checks a release, about 9 minutes:
#   1. the whole test suite on CUDA, 6 workers (pytest-xdist from .whl; the tests that need the embedded
#      model package fail there: it does not travel to the GPU machine)
#   2. the kernel race, MHA: triton vs FlashInfer (decode, prefill, extend), each checked against the oracle
#   3. DeepSeek-V2-Lite (random weights, bf16) in the engine: decode on Triton MLA and FlashInfer MLA
# Run from the repo root with the wheels in .whl/ (fetch-gpu-wheels.sh --server, plus pytest-xdist and execnet):
#   OUT=<results folder> bash benchmarks/run_h200_check.sh
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs"
BUDGET=${BUDGET:-560}
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py > "$LOGS/warm.log" 2>&1 &

echo "== 1. the test suite on CUDA ($(left) s left)"
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n 6")
timeout "$(cap 280)" python3 -m pytest -q -p no:cacheprovider $WORKERS tests > "$LOGS/pytest-h200.log" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest-h200.log" | cut -c1-200 | head -40; tail -1 "$LOGS/pytest-h200.log"
wait

echo "== 2. MHA kernel race ($(left) s left)"
timeout "$(cap 130)" python3 -m attnserve bench kernels --backends triton flashinfer flashinfer-fa3 \
  --json "$OUT/kernels-h200-check.json" --png "$OUT/kernels-h200-check.png" > "$LOGS/bench.log" 2>&1
echo "bench rc=$?"; grep ' / ' "$LOGS/bench.log"

echo "== 3. DeepSeek-V2-Lite in the engine ($(left) s left)"
timeout "$(cap 150)" python3 benchmarks/engine_gpu_decode.py --preset deepseek-v2-lite \
  --workloads 64x1024x128,1x1024x128 --configs triton-graphs,flashinfer-decode,flashinfer \
  --out "$OUT/engine_gpu_deepseek_v2_lite.json" > "$LOGS/decode.log" 2>&1
echo "decode rc=$?"
python3 benchmarks/engine_gpu_summary.py "$OUT/engine_gpu_deepseek_v2_lite.json"
echo "done in $(( $(date +%s) - START )) s"
