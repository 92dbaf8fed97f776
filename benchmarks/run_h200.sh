#!/usr/bin/env bash
# One run on the H200 (see benchmarks/NOTES.md for what each produced):
#   benchmarks/run_h200.sh tune   -> GPU tests + full Triton sweep + race without FlashInfer
#   benchmarks/run_h200.sh final  -> GPU tests + extend sweep + race with FlashInfer
#     (wheels in .whl; FlashInfer's JIT builds run in the background from the start)
#   benchmarks/run_h200.sh variants -> kernel tests + extend kernel variants + prefill race against fa3
# Writes logs and JSON under $OUT (./out when unset).
set -u
MODE=${1:-final}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/smi.txt" 2>&1
TESTS="tests/test_triton_kernels.py tests/test_triton_backend.py"
if [ "$MODE" != tune ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH MAX_JOBS=16
  WARM=""; [ "$MODE" = variants ] && WARM="fa3" && TESTS="tests/test_triton_kernels.py"
  python3 benchmarks/warm_flashinfer.py $WARM > "$OUT/warm.log" 2>&1 &
fi
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider $TESTS \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest.log"
tail -3 "$OUT/pytest.log"
if [ "$MODE" = tune ]; then
  timeout 240 python3 benchmarks/sweep_triton.py --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"
  timeout 150 python3 -m attnserve bench kernels --backends triton 'sdpa*' torch_native \
    --json "$OUT/kernels-no-flashinfer.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
elif [ "$MODE" = variants ]; then
  timeout 150 python3 benchmarks/sweep_triton.py --kinds prefill extend --variants \
    --best-extend "$OUT/best-variant.json" --out "$OUT/sweep-variants.json" > "$OUT/sweep-variants.log" 2>&1
  echo "sweep rc=$?"; cat "$OUT/best-variant.json"; echo
  wait
  timeout "${BENCH_TIMEOUT:-150}" python3 -m attnserve bench kernels --workloads prefill extend \
    --triton-options "$(cat "$OUT/best-variant.json" 2>/dev/null)" --backends triton flashinfer-fa3 \
    --json "$OUT/kernels-h200-prefill-variant.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  cat "$OUT/warm.log"; cat "$OUT/sweep-variants.log"
else
  timeout 110 python3 benchmarks/sweep_triton.py --kinds prefill extend --best-extend "$OUT/best-extend.json" \
    --out "$OUT/sweep-extend.json" > "$OUT/sweep-extend.log" 2>&1
  echo "sweep rc=$?"; cat "$OUT/best-extend.json"; echo
  OPTS=$(cat "$OUT/best-extend.json" 2>/dev/null)
  timeout "${BENCH_TIMEOUT:-280}" python3 -m attnserve bench kernels --triton-options "$OPTS" \
    --backends triton sdpa-cudnn sdpa-flash torch_native flashinfer flashinfer-fa3 flashinfer-fa2 \
    --json "$OUT/kernels-h200.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  cat "$OUT/warm.log"
fi
tail -45 "$OUT/bench.log"
