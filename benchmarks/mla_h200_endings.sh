#!/usr/bin/env bash
# One H200 run for the column-split kernel's split partials, float32 against float16:
#   1. their timing (benchmarks/mla_merge_variants.py, CUDA graphs)
#   2. the race of 1 x 32768 against FlashInfer MLA fa3 with RACE_CONFIG (a mla_decode_config JSON), if set
#   3. the Gluon MLA tests on CUDA (TEST_K: a pytest -k filter)
# Run from the repo root with the FlashInfer wheels in .whl/:  OUT=<results folder> bash benchmarks/mla_h200_endings.sh
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs-endings"
BUDGET=${BUDGET:-560}
. benchmarks/h200_env.sh
if [ -n "${RACE_CONFIG:-}" ]; then
  python3 benchmarks/warm_flashinfer.py "mla fa3" > "$LOGS/warm.log" 2>&1 &
fi
echo "== 1. endings ($(left) s left)"
timeout "$(cap 200)" python3 benchmarks/mla_merge_variants.py ${VARIANT_ARGS:-} --json "$OUT/mla-merge-variants-h200.json" \
  2>&1 | tail -20
if [ -n "${RACE_CONFIG:-}" ]; then
  echo "== 2. race ($(left) s left)"
  wait
  timeout "$(cap 200)" python3 -m attnserve bench kernels --workloads "mla decode 1x32768" \
    --backends triton flashinfer-mla-fa3 --triton-options "{\"mla_decode_config\": $RACE_CONFIG}" \
    --json "$OUT/kernels-mla-1x32768-h200.json" 2>&1 | tail -15
fi
echo "== 3. tests ($(left) s left)"
timeout "$(cap 300)" python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_gluon_mla.py ${TEST_K:+-k "$TEST_K"} \
  > "$LOGS/pytest-gluon.log" 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest-gluon.log" | cut -c1-400; tail -3 "$LOGS/pytest-gluon.log"
