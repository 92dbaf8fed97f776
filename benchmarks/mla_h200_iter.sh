#!/usr/bin/env bash
# One H200 run for the Triton MLA decode tiles (issue 12 follow-up), under 5 minutes:
#   1. the MLA kernel tests on CUDA (kernels against the float oracle, backend, CUDA graphs, the tile table)
#   2. a short sweep of the decode tiles (benchmarks/sweep_triton_mla.py, each workload its time share),
#      whose winners are applied to this checkout's tile table (mla_decode_tiles.json) before the race
#   3. the MLA race with those tiles: triton vs FlashInfer MLA fa3, each checked against the oracle first
# FlashInfer's MLA fa3 JIT build runs in the background from the start.
# Results under $OUT: sweep-triton-mla-h200-2.json (with "tile_rules"), mla_decode_tiles.json (the table
# the race ran), kernels-mla-h200.json (+ PNG), logs-mla-iter/. To keep the tiles without a GPU:
#   python benchmarks/sweep_triton_mla.py --apply <copied sweep-triton-mla-h200-2.json>
#
# Run from the repo root with the FlashInfer wheels in .whl/ (fetch: /work/shared/tools/fetch-gpu-wheels.sh):
#   OUT=<results folder> bash benchmarks/mla_h200_iter.sh      (OUT defaults to benchmarks/results)
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs-mla-iter"
BUDGET=${BUDGET:-285}  # seconds for the whole run
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py "mla fa3" > "$LOGS/warm.log" 2>&1 &
WARM=$!

echo "== 1. MLA kernel tests on CUDA"
timeout "$(cap 55)" python3 -m pytest -q -p no:cacheprovider tests/test_triton_mla.py tests/test_triton_mla_backend.py \
  tests/test_mla_decode_tiles.py > "$LOGS/pytest-mla.log" 2>&1
echo "pytest mla rc=$?"; tail -4 "$LOGS/pytest-mla.log"

echo "== 2. decode tile sweep ($(left) s left)"
SWEEP="$OUT/sweep-triton-mla-h200-2.json"
timeout "$(cap 150)" python3 benchmarks/sweep_triton_mla.py --decode-only --budget-s $(( $(left) - 105 )) \
  --out "$SWEEP" > "$LOGS/sweep-mla.log" 2>&1
echo "sweep rc=$?"; grep -v '^{' "$LOGS/sweep-mla.log" | grep -A60 '^best' | grep -v '"rel_err"' | head -80
python3 benchmarks/sweep_triton_mla.py --apply "$SWEEP" 2>&1 | tail -1
cp src/attnserve/attention/kernels/mla_decode_tiles.json "$OUT/"

echo "== 3. MLA race with the applied tiles ($(left) s left)"
timeout "$(cap 100)" python3 -m attnserve bench kernels --workloads mla --backends triton flashinfer-mla-fa3 \
  --json "$OUT/kernels-mla-h200.json" > "$LOGS/bench-mla.log" 2>&1
echo "bench mla rc=$?"; grep -A12 '^results' "$LOGS/bench-mla.log"; grep ' / ' "$LOGS/bench-mla.log"
kill "$WARM" 2>/dev/null
echo "== FlashInfer build"; tail -3 "$LOGS/warm.log"
echo "done in $(( $(date +%s) - START )) s"
