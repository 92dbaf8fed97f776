#!/usr/bin/env bash
# Where a served run's engine process spends its time: `attnserve serve` launched with the budget sweep's flags,
# warmed with one wave, then py-spy samples the engine process (non-blocking) through a timed closed-loop point
# of `attnserve bench serve --url`. Writes $OUT/serve-profile/{engine.txt (collapsed stacks), top.txt (functions
# by inclusive share of samples), bench.json, server.log}.
#   OUT=<folder> [SERVE_FLAGS=...] [C=64] [N=200] bash benchmarks/serve_profile.sh [--tiny]
#   (--tiny: the embedded model on a CPU, 4 streams; needs py-spy on PATH or in /tmp/site/bin)
set -u
OUT=${OUT:-out}/serve-profile
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
PORT=${PORT:-30123}
if [ "${1:-}" = "--tiny" ]; then
  C=${C:-4}; N=${N:-8}; LEN=(--input-len 32 --output-len 8); TOK=()
  FLAGS=${SERVE_FLAGS:-"--device cpu --max-running-requests 4"}
else
  M=${MODEL_DIR:-/tmp/llama3-8b-random}
  timeout 120 python3 benchmarks/serve_h200_model.py "$M" --no-weights > "$OUT/model.log" 2>&1
  C=${C:-64}; N=${N:-200}; LEN=(--input-len 1024 --output-len 256); TOK=(--tokenizer "$M")
  FLAGS=${SERVE_FLAGS:-"--model $M --random-weights --attention-backend triton --disable-radix-cache --max-running-requests 64 --chunked-prefill-size 8192 --api-workers 2"}
fi
# shellcheck disable=SC2086
python3 -m attnserve serve $FLAGS --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2> /dev/null; wait $SERVER 2> /dev/null' EXIT
URL=http://127.0.0.1:$PORT
for _ in $(seq 240); do curl -sf "$URL/health" > /dev/null && break; sleep 1; done
ENGINE=$(curl -sf "$URL/server_info" | python3 -c "import json, sys; print(json.load(sys.stdin)['processes']['engine'])") \
  || { echo "the server did not come up:"; tail -20 "$OUT/server.log"; exit 1; }
bench() {  # bench serve against the running server; the rest of the arguments are its load
  python3 -m attnserve bench serve --url "$URL" --dataset-name random "${LEN[@]}" "${TOK[@]}" --no-progress \
    --max-point-seconds 120 "$@"
}
bench --concurrency "$C" --num-prompts "$C" --warmup-requests 0 --seed 7 > "$OUT/warmup.log" 2>&1
"$PYSPY" record --nonblocking --idle --pid "$ENGINE" --rate 200 --format raw --output "$OUT/engine.txt" --duration 600 \
  > "$OUT/py-spy.log" 2>&1 &
SPY=$!
sleep 1
bench --concurrency "$C" --num-prompts "$N" --warmup-requests 0 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
kill -INT $SPY 2> /dev/null; wait $SPY 2> /dev/null
grep -E "=>" "$OUT/bench.log"
python3 benchmarks/collapsed_top.py "$OUT/engine.txt" 40 | tee "$OUT/top.txt"
