#!/usr/bin/env bash
# One H200 run for the TMA prefill path (kernels/prefill_tma.py), under 4 minutes:
#   1. warp specialisation: which variants finish (benchmarks/diagnose_prefill_ws.py, each in a child process
#      under a time limit; one that does not finish prints where it waits)
#   2. the TMA path's tests on CUDA (the warp-specialised shapes only when step 1 saw ours finish correctly)
#      and the paged kernels' extend tests
#   3. a short sweep of the TMA tiles (warp-specialised first when step 1 allows; the paged kernel as the same
#      run's baseline); the best config so far is kept after every config
#   4. the prefill / extend race with that config: triton vs FlashInfer fa3, each checked against the oracle;
#      the records name the kernel that ran ("kernel_path")
# FlashInfer's fa3 JIT build runs in the background from the start.
# Results under $OUT (4 files): diagnose-ws-h200.json, sweep-prefill-tma-h200.json, kernels-prefill-h200.json,
# prefill-iter-logs.txt.
#
# Run from the repo root with the FlashInfer wheels in .whl/ (fetch: /work/shared/tools/fetch-gpu-wheels.sh):
#   OUT=<results folder> bash benchmarks/prefill_h200_iter.sh      (OUT defaults to benchmarks/results)
#   FINAL=1 ...: steps 2 and 4 only, the race with the package's defaults (about 2 minutes)
set -u
OUT=${OUT:-benchmarks/results}
LOGS=${LOGS:-/tmp/prefill-iter-logs}
BUDGET=${BUDGET:-230}  # seconds for the whole run
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py "prefill fa3" "extend fa3" > "$LOGS/warm.log" 2>&1 &
WARM=$!

FINAL=${FINAL:-0}
WS_OK=1; NOWS=""; WSFLAG=""
if [ "$FINAL" != 1 ]; then
echo "== 1. warp specialisation diagnosis"
timeout "$(cap 50)" python3 benchmarks/diagnose_prefill_ws.py --timeout 12 ours minimal-dev minimal \
  --out "$OUT/diagnose-ws-h200.json" 2>&1 | cut -c1-700
WS_OK=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(int(any(x['variant']=='ours' and x.get('rel_err_vs_sdpa',1)<1e-2 for x in r)))" "$OUT/diagnose-ws-h200.json" 2>/dev/null || echo 0)
echo "warp-specialised kernel usable: $WS_OK"
NOWS=""; WSFLAG=""
if [ "$WS_OK" = 1 ]; then WSFLAG="--warp-specialized"; else NOWS=" and not ws1"; fi
fi

echo "== 2. tests on CUDA ($(left) s left)"
timeout "$(cap 45)" python3 -m pytest -q -p no:cacheprovider tests/test_prefill_tma.py tests/test_triton_kernels.py \
  tests/test_triton_backend.py -k "(tma or slots or extend or fall or switched or blockers)$NOWS" \
  > "$LOGS/pytest.log" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$LOGS/pytest.log" | tail -8

if [ "$FINAL" != 1 ]; then
echo "== 3. TMA tile sweep ($(left) s left) $WSFLAG"
SWEEP_S=$(( $(left) - 80 )); [ "$SWEEP_S" -lt 20 ] && SWEEP_S=20  # the race keeps 80 s
timeout "$SWEEP_S" python3 benchmarks/sweep_prefill_tma.py $WSFLAG --budget-s $(( SWEEP_S - 20 )) \
  --out "$OUT/sweep-prefill-tma-h200.json" --best-options "$LOGS/best.json" > "$LOGS/sweep.log" 2>&1
echo "sweep rc=$?"; grep -v "^ \|^Traceback\|^  File" "$LOGS/sweep.log" | cut -c1-200 | tail -30
RACE_OPTS=${RACE_OPTS:-$(cat "$LOGS/best.json" 2>/dev/null)}
fi

echo "== 4. prefill / extend race ($(left) s left) with ${RACE_OPTS:-the defaults}"
RACE_OPTS=${RACE_OPTS:-}
cat "$LOGS/warm.log"
timeout "$(cap 90)" python3 -m attnserve bench kernels --workloads prefill extend --backends triton flashinfer-fa3 \
  ${RACE_OPTS:+--triton-options "$RACE_OPTS"} --json "$OUT/kernels-prefill-h200.json" --png "$LOGS/kernels.png" \
  > "$LOGS/bench.log" 2>&1
echo "bench rc=$?"; grep -A10 '^results' "$LOGS/bench.log"; grep ' / ' "$LOGS/bench.log"
kill "$WARM" 2>/dev/null
for f in versions.txt smi.txt warm.log pytest.log sweep.log bench.log; do
  echo "===== $f"; tail -n 150 "$LOGS/$f" 2>/dev/null
done > "$OUT/prefill-iter-logs.txt"
echo "done in $(( $(date +%s) - START )) s"
