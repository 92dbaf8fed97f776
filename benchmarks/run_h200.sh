#!/usr/bin/env bash
# One device call: GPU tests of the Triton backend, the Triton sweep, and the kernel race.
#   benchmarks/run_h200.sh tune   -> tests + sweep + race without FlashInfer
#   benchmarks/run_h200.sh final  -> tests + race with FlashInfer (wheels in .whl, JIT warmed in the background)
# Writes logs and JSON under $OUT (or ./out when unset).
set -u
MODE=${1:-final}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/smi.txt" 2>&1
if [ "$MODE" = final ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH MAX_JOBS=16
  python3 benchmarks/warm_flashinfer.py > "$OUT/warm_flashinfer.log" 2>&1 &
fi
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_backend.py \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest.log"; tail -3 "$OUT/pytest.log"
if [ "$MODE" = tune ]; then
  timeout 240 python3 benchmarks/sweep_triton.py --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"; grep -c us "$OUT/sweep.log"
  timeout 150 python3 -m attnserve bench kernels --backends triton sdpa torch_native \
    --json "$OUT/kernels-no-flashinfer.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
else

  timeout 420 python3 -m attnserve bench kernels --json "$OUT/kernels-h200.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
fi
tail -40 "$OUT/bench.log"
