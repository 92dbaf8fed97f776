#!/usr/bin/env bash
# The serving run on one H200, in one call of at most 10 minutes (sized for about 8):
#   1. a Llama-3-8B-shaped model directory with random bf16 weights and a word-level tokenizer;
#      meanwhile, and niced, FlashInfer's JIT kernels build in the background (decode ~25 s, then
#      the fa3 prefill kernels the default selection uses, ~100 s each);
#   2. the offline engine on the same shapes (benchmarks/engine_gpu_decode.py: output tok/s,
#      decode step, copy bandwidth, weight bytes) for the targets, and once more with one request;
#   3. `attnserve bench serve` launching our server with --attention-backend triton and with
#      --decode-attention-backend flashinfer;
#   4. the same sweep with --url against `transformers serve --continuous-batching` on the same
#      directory (the peer), with a time budget per point;
#   5. our server with the default selection (FlashInfer fa3 prefill + Triton decode on the H200:
#      last, so its prefill kernels have finished building);
#   6. benchmarks/serve_h200_report.py merges all into serve-h200.{json,md,png} with the targets.
# Every phase has a deadline so the report is always written, saying what did not run.
#
# Run from the repository root, with the server and FlashInfer wheels carried (not on the GPU image):
#   /work/shared/tools/fetch-gpu-wheels.sh --server     # here, once: fills .whl/
#   run(command="OUT=$OUT benchmarks/serve_h200.sh", carry=[".whl"])
# then copy $OUT/serve-h200.{json,md,png} to benchmarks/results/.
set -u
OUT=${OUT:-out}
MODEL_DIR=${MODEL_DIR:-/tmp/llama3-8b-random}
# knobs for a smoke run of this script on a CPU (defaults are the H200 run):
#   PEER_DEVICE=cpu MODEL_ARGS=--tiny IN_LEN=64 OUT_LEN=8 OUT=/tmp/smoke benchmarks/serve_h200.sh
PEER_DEVICE=${PEER_DEVICE:-cuda}
MODEL_ARGS=${MODEL_ARGS:-}
IN_LEN=${IN_LEN:-1024}
OUT_LEN=${OUT_LEN:-256}
BUDGET_S=${BUDGET_S:-540}          # the whole script, leaving a minute of the 10 for start-up and transfers
START=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo $(( l > 5 ? l - 5 : 1 )); }
mkdir -p "$OUT/logs"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/smi.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/logs/pip.log" 2>&1
  export PYTHONPATH=src:/tmp/site${PYTHONPATH#src}
fi
python3 -m pip list --path /tmp/site 2>/dev/null > "$OUT/versions-carried.txt"
python3 -m pip list 2>/dev/null | grep -i -E "^(torch|triton|transformers|aiohttp) " > "$OUT/versions.txt"
NOTES=()
MAX_JOBS=16 timeout 330 nice -n 19 python3 benchmarks/warm_flashinfer.py "decode tensor cores" "prefill fa3" "extend fa3" \
  > "$OUT/logs/warm-flashinfer.log" 2>&1 &

echo "[$(left) s left] model directory"
timeout "$(cap 150)" python3 benchmarks/serve_h200_model.py "$MODEL_DIR" $MODEL_ARGS > "$OUT/logs/model.log" 2>&1
echo "model rc=$?"; tail -2 "$OUT/logs/model.log"

echo "[$(left) s left] offline engine"
timeout "$(cap 100)" python3 benchmarks/engine_gpu_decode.py --configs triton-graphs,flashinfer-decode \
  --workloads "64x${IN_LEN}x${OUT_LEN}" --out "$OUT/engine-offline.json" > "$OUT/logs/offline.log" 2>&1
echo "offline rc=$?"; tail -3 "$OUT/logs/offline.log"
# one request alone: the engine's own batch-1 decode step, to split c=1 TPOT into engine and server time
timeout "$(cap 45)" python3 benchmarks/engine_gpu_decode.py --configs triton-graphs --workloads "1x${IN_LEN}x${OUT_LEN}" \
  --out "$OUT/engine-offline-c1.json" > "$OUT/logs/offline-c1.log" 2>&1
echo "offline c=1 rc=$?"

# Shared by ours and the peer: the issue's shape and points. Seeds 3 at c=1 and c=8, 1 at c=32 and c=64;
# one wave of requests per point (Nx = N per client) except 2 per client at c=1.
SWEEP=(--dataset random --input-len "$IN_LEN" --output-len "$OUT_LEN" --tokenizer "$MODEL_DIR" --concurrency 1,8,32,64
       --no-progress --server-log-dir "$OUT/logs")
OURS=("${SWEEP[@]}" --seeds 3,3,1,1 --num-prompts 2x,1x,1x,1x --warmup-requests 2 --title "attnserve serve"
      --launch "--model $MODEL_DIR --random-weights --chunked-prefill-size 8192 --disable-radix-cache --max-running-requests 64")
NOTES+=("reduced to fit one 10-minute GPU call: seeds 3 at concurrency 1 and 8 and 1 at 32 and 64; prompts per point and seed 2 at c=1 and one wave (= concurrency) at 8, 32, 64")
NOTES+=("our servers load $MODEL_DIR with --random-weights (its config and tokenizer, weights drawn on the GPU: same shapes, no 16 GB read per launch); the peer loads the directory's safetensors")
NOTES+=("engine settings as in the offline run: --chunked-prefill-size 8192 --disable-radix-cache --max-running-requests 64")

echo "[$(left) s left] attnserve bench serve: triton, flashinfer decode"
timeout "$(cap 200)" python3 -m attnserve bench serve "${OURS[@]}" \
  --compare "triton=--attention-backend triton" "flashinfer-decode=--decode-attention-backend flashinfer" \
  --json "$OUT/ours-a.json" > "$OUT/logs/ours-a.log" 2>&1
echo "ours rc=$?"; grep "^|" "$OUT/logs/ours-a.log" | tail -9

PEER_S=$(left)
if [ "$PEER_S" -gt 150 ]; then
  echo "[$PEER_S s left] peer: transformers serve --continuous-batching"
  PORT=8011
  python3 -m transformers.cli.transformers serve "$MODEL_DIR" --continuous-batching --device "$PEER_DEVICE" --dtype bfloat16 \
    --host 127.0.0.1 --port $PORT > "$OUT/logs/peer.log" 2>&1 &
  PEER_PID=$!
  python3 - "$PORT" "$PEER_PID" "$(cap 90)" <<'EOF'
import os, sys, time, urllib.request
port, pid, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
end = time.time() + limit
while time.time() < end:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("peer exited before /health answered")
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit("peer /health did not answer in time")
EOF
  echo "peer health rc=$?"
  # a time budget per point, leaving ~80 s for the default configuration after the peer
  POINT_S=$(( ($(left) - 80 - 40) / 4 )); [ "$POINT_S" -gt 25 ] && POINT_S=25; [ "$POINT_S" -lt 5 ] && POINT_S=5
  NOTES+=("peer: 1 seed per point, one wave per point, time budget $POINT_S s per point (requests still running then are cut and counted apart; their streamed tokens count toward tok/s); ignore_eos not sent (transformers serve refuses unknown fields), so a request may end early at the random model's EOS: usage.completion_tokens is what is counted")
  timeout "$(cap $(( POINT_S * 4 + 40 )))" python3 -m attnserve bench serve "${SWEEP[@]}" --seeds 1 --num-prompts 1x \
    --warmup-requests 1 --max-point-seconds "$POINT_S" --no-ignore-eos --model-name "$MODEL_DIR" \
    --url "peer=http://127.0.0.1:$PORT" --title "transformers serve (peer)" --json "$OUT/peer.json" \
    > "$OUT/logs/peer-bench.log" 2>&1
  echo "peer bench rc=$?"; grep "^|" "$OUT/logs/peer-bench.log" | tail -5
  kill "$PEER_PID" 2>/dev/null; sleep 3; kill -9 "$PEER_PID" 2>/dev/null
else
  NOTES+=("the peer was not run: only $PEER_S s of the call's budget were left after our first sweep")
fi

echo "[$(left) s left] attnserve bench serve: default selection"
tail -3 "$OUT/logs/warm-flashinfer.log"
timeout "$(cap 150)" python3 -m attnserve bench serve "${OURS[@]}" --compare "default=" \
  --json "$OUT/ours-b.json" > "$OUT/logs/ours-b.log" 2>&1
echo "default rc=$?"; grep "^|" "$OUT/logs/ours-b.log" | tail -5

NOTES+=("FlashInfer JIT builds in the background (nice 19) during the first phases: $(grep -E 'built in|failed after' \
  "$OUT/logs/warm-flashinfer.log" 2>/dev/null | cut -c1-80 | tr '\n' ';')")
ARGS=()
for n in "${NOTES[@]}"; do ARGS+=(--note "$n"); done
python3 benchmarks/serve_h200_report.py --ours "$OUT/ours-a.json" --ours "$OUT/ours-b.json" --peer "$OUT/peer.json" \
  --offline "$OUT/engine-offline.json" --offline-c1 "$OUT/engine-offline-c1.json" --peer-log "$OUT/logs/peer.log" \
  --out "$OUT/serve-h200.json" "${ARGS[@]}" > "$OUT/logs/report.log" 2>&1
echo "report rc=$?"; cat "$OUT/serve-h200.md" 2>/dev/null || tail -20 "$OUT/logs/report.log"
echo "done in $(( $(date +%s) - START )) s"
