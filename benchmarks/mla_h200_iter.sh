#!/usr/bin/env bash
# One H200 run for the Triton MLA decode tiles (issue 12 follow-up), under 4.5 minutes:
#   1. the MLA kernel tests on CUDA (kernels against the float oracle, backend, CUDA graphs, the tile table,
#      a tiny real-latent DeepSeek through the engine with CUDA graphs on every MLA backend)
#   2. a short sweep of the decode tiles (with their split waves) and of the extend tiles
#      (benchmarks/sweep_triton_mla.py, each workload its time share), whose decode winners are applied to this
#      checkout's tile table (mla_decode_tiles.json) before the race
#   3. the MLA race with those tiles and the fastest extend tile: triton vs FlashInfer MLA fa3, each checked
#      against the oracle first
# RUN_SWEEP=0 leaves out step 2 (the race then runs the checkout's tiles). SPLIT_COST_ARGS (e.g. "--splits 64"):
# also time benchmarks/mla_split_cost.py with those arguments before the race. TESTS / TEST_K: the test files and a
# pytest -k filter of step 1; STOP_ON_TEST_FAIL=1 ends the run there if they fail (a kernel under test that
# hangs or is wrong is not timed). RACE_OPTIONS: the triton options of step 3's race (default: the swept extend
# tile, if any).
# FlashInfer's MLA fa3 JIT build runs in the background from the start.
# Results under $OUT: $SWEEP_NAME (default sweep-triton-mla-h200-8.json) (with "tile_rules"), mla_decode_tiles.json (the table
# the race ran), kernels-mla-h200.json (+ PNG), logs-mla-iter/. To keep the tiles without a GPU:
#   python benchmarks/sweep_triton_mla.py --apply <copied sweep json>
#
# Run from the repo root with the FlashInfer wheels in .whl/ (fetch: /work/shared/tools/fetch-gpu-wheels.sh):
#   OUT=<results folder> bash benchmarks/mla_h200_iter.sh      (OUT defaults to benchmarks/results)
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs-mla-iter"
BUDGET=${BUDGET:-270}  # seconds for the whole run
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py "mla fa3" > "$LOGS/warm.log" 2>&1 &
WARM=$!

echo "== 1. MLA kernel tests on CUDA"
TESTS=${TESTS:-tests/test_triton_mla.py tests/test_triton_mla_backend.py tests/test_mla_decode_tiles.py \
  tests/test_engine_gpu_mla.py tests/test_gluon_mla.py}
timeout "$(cap ${TEST_CAP:-110})" python3 -m pytest -q -p no:cacheprovider $TESTS ${TEST_K:+-k "$TEST_K"} \
  > "$LOGS/pytest-mla.log" 2>&1
TEST_RC=$?
echo "pytest mla rc=$TEST_RC"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest-mla.log" | cut -c1-300; tail -1 "$LOGS/pytest-mla.log"
if [ "$TEST_RC" != 0 ] && [ "${STOP_ON_TEST_FAIL:-0}" = 1 ]; then
  kill "$WARM" 2>/dev/null; echo "stopped: the tests failed"; exit 1
fi

EXT="{}"
if [ "${RUN_SWEEP:-1}" != 0 ]; then
echo "== 2. decode + extend tile sweep ($(left) s left)"
SWEEP="$OUT/${SWEEP_NAME:-sweep-triton-mla-h200-8.json}"
SWEEP_S=$(cap "${SWEEP_CAP:-170}")  # the sweep stops starting settings 30 s before its timeout
timeout "$SWEEP_S" python3 benchmarks/sweep_triton_mla.py ${SWEEP_ARGS:-} --budget-s $(( SWEEP_S - 30 )) \
  --out "$SWEEP" > "$LOGS/sweep-mla.log" 2>&1
echo "sweep rc=$?"
python3 - "$SWEEP" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    tiled = "block_h" in r or "block_m" in r
    tile = "/".join(str(r[k]) for k in ("block_h", "block_m", "block_n", "num_warps", "num_stages", "defer_pv",
                                        "split_waves", "kernel", "partials") if k in r and tiled)
    split = {k: r[k] for k in ("split_waves", "max_kv_splits") if k in r and not tiled}
    print(f"{r['workload'][11:]:18s} {tile:22s} {json.dumps(split) if split else '':40s} "
          f"{r.get('us', r.get('error', '?'))}")
print("rules:", json.dumps([[x["config"], x["min_heads"], x["min_page_size"]] for x in d["tile_rules"]]))
PY
python3 benchmarks/sweep_triton_mla.py --apply "$SWEEP" 2>&1 | tail -1
cp src/attnserve/attention/kernels/mla_decode_tiles.json "$OUT/"

# the extend tile the sweep timed fastest (the extend defaults are code, mla_extend.MLA_EXTEND_TILES)
EXT=$(python3 - "$SWEEP" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "block_m" in r and "us" in r]
keys = ("block_m", "block_n", "num_warps", "num_stages", "defer_pv")
print(json.dumps({"mla_extend_config": {k: min(rows, key=lambda r: r["us"])[k] for k in keys}}) if rows else "{}")
PY
)
echo "extend tile raced: $EXT"
fi

if [ -n "${SPLIT_COST_ARGS:-}" ]; then
echo "== 2b. a split's cost apart from its tiles, 1 long request (benchmarks/mla_split_cost.py $SPLIT_COST_ARGS)"
timeout "$(cap 150)" python3 benchmarks/mla_split_cost.py $SPLIT_COST_ARGS --json "$OUT/mla-split-cost-h200.json" \
  > "$LOGS/split-cost.log" 2>&1
echo "split cost rc=$?"; grep -v '^{' "$LOGS/split-cost.log" | tail -20
fi

echo "== 3. MLA race with the applied tiles ($(left) s left)"
timeout "$(cap 130)" python3 -m attnserve bench kernels --workloads mla --backends triton flashinfer-mla-fa3 \
  --triton-options "${RACE_OPTIONS:-$EXT}" --json "$OUT/kernels-mla-h200.json" > "$LOGS/bench-mla.log" 2>&1
echo "bench mla rc=$?"; grep -A12 '^results' "$LOGS/bench-mla.log"; grep ' / ' "$LOGS/bench-mla.log"

kill "$WARM" 2>/dev/null
echo "== FlashInfer build"; tail -3 "$LOGS/warm.log"
echo "done in $(( $(date +%s) - START )) s"
