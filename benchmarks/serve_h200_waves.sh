#!/usr/bin/env bash
# Three waves of 64 concurrent streams on the one-process server and on --api-workers 2, as users run them on
# the H200 (Llama-3-8B shape, random weights, triton backend, 1024 in / 256 out, the default step budget):
# 64 warm-up streams, then 192 requests at concurrency 64 (three waves), each server launched by
# `attnserve bench serve --launch`. Passes when every request of both servers completes (none cut, none
# failed). Writes $OUT/serve-waves.{json,md,png} and the servers' logs under $OUT/logs.
#   OUT=<folder> bash benchmarks/serve_h200_waves.sh [--tiny]   (--tiny: the embedded model on a CPU, 3 x 4)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT/logs"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ "${1:-}" = "--tiny" ]; then
  C=4; N=12; LEN=(--input-len 32 --output-len 8); LAUNCH="--device cpu --max-running-requests 4"; TOK=()
else
  M=${MODEL_DIR:-/tmp/llama3-8b-random}
  timeout 120 python3 benchmarks/serve_h200_model.py "$M" --no-weights > "$OUT/logs/waves-model.log" 2>&1
  C=64; N=192; LEN=(--input-len 1024 --output-len 256); TOK=(--tokenizer "$M")
  LAUNCH="--model $M --random-weights --attention-backend triton --disable-radix-cache --max-running-requests 64"
fi
timeout "${WAVES_TIMEOUT:-420}" python3 -m attnserve bench serve --launch "$LAUNCH" \
  --compare "one-process=" "api-workers-2=--api-workers 2" --dataset-name random "${LEN[@]}" "${TOK[@]}" \
  --concurrency "$C" --num-prompts "$N" --warmup-requests "$C" --max-point-seconds 150 --no-progress \
  --server-log-dir "$OUT/logs" --json "$OUT/serve-waves.json" 2>&1 | tee "$OUT/logs/serve-waves.log" | grep "^|"
python3 - "$OUT/serve-waves.json" "$N" <<'PY'
import json, sys
report, n = json.load(open(sys.argv[1])), int(sys.argv[2])
bad = [cfg["label"] for cfg in report["configs"] if cfg.get("error") or not cfg.get("points")]
for cfg in report["configs"]:
    for point in cfg.get("points", []):
        m = point["median"]
        ok = m["completed"] == n and not m["failed"] and not m["cut_by_time_budget"]
        print(f"{cfg['label']}: {m['completed']}/{n} completed, {m['failed']} failed, {m['cut_by_time_budget']} cut,"
              f" {m['output_tok_s']:.0f} output tok/s -> {'ok' if ok else 'STALLED'}")
        bad += [] if ok else [cfg["label"]]
sys.exit(1 if bad else 0)
PY
