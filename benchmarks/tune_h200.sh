#!/usr/bin/env bash
# `attnserve tune --model llama-3-8b` on the H200 with FlashInfer, and the selection trace that cites it.
#
# Here, once:  ../shared/tools/fetch-gpu-wheels.sh     (FlashInfer + tvm-ffi + gguf wheels into .whl/)
# Device run, carrying .whl:  bash benchmarks/tune_h200.sh
# Writes to $OUT (benchmarks/results when unset): tune-h200-llama-3-8b.json (the result, as written to the
# cache), .txt (the table), .log (notes, progress), -select.json / -select.txt (`attnserve select` citing it).
# Copy those into benchmarks/results/. Budget: FlashInfer's JIT (decode ~20 s, fa3 prefill ~100 s, built in
# the background from the start) plus the race, under 5 minutes; a run cut off at TUNE_TIMEOUT leaves the
# per-workload checkpoint as tune-h200-llama-3-8b.partial.json instead.
set -u
OUT=${OUT:-benchmarks/results}
NAME=tune-h200-llama-3-8b
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16
ATTNSERVE_CACHE_DIR=$(mktemp -d)
export ATTNSERVE_CACHE_DIR
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
  python3 benchmarks/warm_flashinfer.py "decode tensor" fa3 > "$OUT/$NAME-warm.log" 2>&1 &
else
  echo "no .whl/ carried: racing without FlashInfer"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/$NAME-smi.txt" 2>&1
start=$(date +%s)
timeout "${TUNE_TIMEOUT:-420}" python3 -m attnserve tune --model llama-3-8b > "$OUT/$NAME.txt" 2> "$OUT/$NAME.log"
echo "tune rc=$? in $(( $(date +%s) - start )) s"
if ls "$ATTNSERVE_CACHE_DIR"/tune-*.json > /dev/null 2>&1; then
  cp "$ATTNSERVE_CACHE_DIR"/tune-*.json "$OUT/$NAME.json"
else
  cp "$ATTNSERVE_CACHE_DIR"/tune-*.partial "$OUT/$NAME.partial.json" 2> /dev/null
  echo "no complete result; the checkpoint is $OUT/$NAME.partial.json"
fi
python3 -m attnserve select --model llama-3-8b --json > "$OUT/$NAME-select.json" 2>&1
python3 -m attnserve select --model llama-3-8b > "$OUT/$NAME-select.txt" 2>&1
wait
cat "$OUT/$NAME.txt"
grep -v "race/s" "$OUT/$NAME.log" | tail -20
cat "$OUT/$NAME-select.txt"
