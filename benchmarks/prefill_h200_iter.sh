#!/usr/bin/env bash
# One H200 run for the TMA prefill path (kernels/prefill_tma.py), under 4 minutes:
#   1. the Triton kernel tests on CUDA: the TMA path (compiled, warp-specialised) and the paged kernels
#   2. the prefill / extend race: triton (TMA path, defaults) vs FlashInfer fa3, each checked against the
#      oracle first; the records name the kernel that ran ("kernel_path")
#   3. with the time left, the TMA tile sweep (benchmarks/sweep_prefill_tma.py; the paged kernel as baseline)
# FlashInfer's fa3 JIT builds run in the background from the start.
# Results under $OUT (3 files): kernels-prefill-h200.json, sweep-prefill-tma-h200.json, prefill-iter-logs.txt.
#
# Run from the repo root with the FlashInfer wheels in .whl/ (fetch: /work/shared/tools/fetch-gpu-wheels.sh):
#   OUT=<results folder> bash benchmarks/prefill_h200_iter.sh      (OUT defaults to benchmarks/results)
set -u
OUT=${OUT:-benchmarks/results}
LOGS=${LOGS:-/tmp/prefill-iter-logs}
BUDGET=${BUDGET:-235}  # seconds for the whole run
RACE_OPTS=${RACE_OPTS:-}  # e.g. '{"prefill_tma_config": {"block_n": 64, "num_stages": 3}}'
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py "prefill fa3" "extend fa3" > "$LOGS/warm.log" 2>&1 &
WARM=$!

echo "== 1. Triton kernel tests on CUDA"
timeout "$(cap 60)" python3 -m pytest -q -p no:cacheprovider tests/test_prefill_tma.py tests/test_triton_kernels.py \
  tests/test_triton_backend.py > "$LOGS/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|Error|error:" "$LOGS/pytest.log" | tail -8

echo "== 2. prefill / extend race ($(left) s left)"
# the fa3 build started with the tests; the race builds whatever is still missing
cat "$LOGS/warm.log"
timeout "$(cap 90)" python3 -m attnserve bench kernels --workloads prefill extend --backends triton flashinfer-fa3 \
  ${RACE_OPTS:+--triton-options "$RACE_OPTS"} --json "$OUT/kernels-prefill-h200.json" --png "$LOGS/kernels.png" \
  > "$LOGS/bench.log" 2>&1
echo "bench rc=$?"; grep -A10 '^results' "$LOGS/bench.log"; grep ' / ' "$LOGS/bench.log"

echo "== 3. TMA tile sweep ($(left) s left)"
if [ "$(left)" -gt 30 ]; then
  timeout "$(cap 200)" python3 benchmarks/sweep_prefill_tma.py --budget-s $(( $(left) - 25 )) \
    --out "$OUT/sweep-prefill-tma-h200.json" > "$LOGS/sweep.log" 2>&1
  echo "sweep rc=$?"; grep -v "^ \|^Traceback\|^  File" "$LOGS/sweep.log" | tail -45
fi
kill "$WARM" 2>/dev/null
for f in versions.txt smi.txt warm.log pytest.log bench.log sweep.log; do
  echo "===== $f"; tail -n 150 "$LOGS/$f" 2>/dev/null
done > "$OUT/prefill-iter-logs.txt"
echo "done in $(( $(date +%s) - START )) s"
