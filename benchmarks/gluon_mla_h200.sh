#!/usr/bin/env bash
# One H200 run for the Gluon MLA decode kernel (issue 12), under 5 minutes:
#   1. its ptxas report (registers, spills, shared memory, wgmma shapes) and the MLA kernel tests on CUDA
#      (the Gluon kernel against the float oracle over pages 1/16/64, splits on and off, 128 and 16 heads)
#   2. the MLA decode race: triton with the Gluon kernel (split waves 1) against FlashInfer MLA fa3, each
#      checked against the oracle first
#   3. where the Gluon kernel's time goes (benchmarks/gluon_mla_ablate.py)
# FlashInfer's MLA fa3 JIT build runs in the background from the start.
# Results under $OUT: kernels-mla-gluon-h200.json (+ PNG), gluon-mla-ablate-h200.json, logs-gluon/.
#   OUT=<results folder> bash benchmarks/gluon_mla_h200.sh      (OUT defaults to benchmarks/results)
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs-gluon"
BUDGET=${BUDGET:-290}
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py "mla fa3" > "$LOGS/warm.log" 2>&1 &
WARM=$!

echo "== 1. compile report and the Gluon kernels against the oracle"
python3 benchmarks/compile_mla_sm90.py --gluon 1 --gluon-ws 1 --json 2>&1 | tail -2
timeout "$(cap 100)" python3 -m pytest -q -x -p no:cacheprovider tests/test_gluon_mla.py ${PYTEST_ARGS:-} > "$LOGS/pytest-gluon.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|Error|assert" "$LOGS/pytest-gluon.log" | head -20

for K in ${KERNELS:-gluon_ws gluon}; do
  echo "== 2. race, $K at split waves 1 ($(left) s left)"
  G="{\"mla_decode_config\": {\"block_h\": 64, \"block_n\": 64, \"num_warps\": 8, \"num_stages\": 2, \"kernel\": \"$K\", \"split_waves\": 1}}"
  timeout "$(cap 90)" python3 -m attnserve bench kernels --workloads "mla decode" --backends triton flashinfer-mla-fa3 \
    --triton-options "$G" --json "$OUT/kernels-mla-$K-h200.json" > "$LOGS/bench-$K.log" 2>&1
  echo "bench rc=$?"; grep -A10 '^results' "$LOGS/bench-$K.log"; grep ' / ' "$LOGS/bench-$K.log"
done
kill "$WARM" 2>/dev/null
echo "== FlashInfer build"; tail -3 "$LOGS/warm.log"
echo "done in $(( $(date +%s) - START )) s"
echo "== 3. ablation ($(left) s left)"
timeout "$(cap 90)" python3 benchmarks/gluon_mla_ablate.py ${ABLATE_ARGS:-} --json "$OUT/gluon-mla-ablate-h200.json" 2>&1 | tail -12
