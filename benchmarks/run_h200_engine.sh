#!/usr/bin/env bash
# One H200 call for the engine at the roofline (issue 11), about 7 minutes: the fused-ops and overlap tests
# on CUDA, the decode benchmark (overlap on/off, fused off, FlashInfer decode; 64 x 1024/256 and one request)
# and the per-kind step profile. Run from the repo root with the FlashInfer wheels in .whl/:
#   OUT=<results folder> bash benchmarks/run_h200_engine.sh
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT/logs"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/logs/pip.log" 2>&1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
  python3 benchmarks/warm_flashinfer.py "decode tensor" > "$OUT/logs/warm.log" 2>&1 &
fi
echo "== tests on CUDA"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ops_kernels.py tests/test_ops_fused_model.py \
  tests/test_engine_overlap.py tests/test_engine_gpu.py tests/test_engine_cuda_graph.py > "$OUT/logs/pytest-engine.log" 2>&1
echo "pytest rc=$?"; tail -6 "$OUT/logs/pytest-engine.log"
wait
echo "== decode"
timeout 300 python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256,1x1024x256 \
  --configs triton-graphs,triton-graphs-no-overlap,triton-graphs-unfused,flashinfer-decode \
  --out "$OUT/engine_gpu_decode.json" > "$OUT/logs/decode.log" 2>&1
echo "decode rc=$?"; tail -30 "$OUT/logs/decode.log"
echo "== profile"
timeout 100 python3 benchmarks/engine_gpu_profile.py --steps 8 --modes graphs --out "$OUT/engine_gpu_profile.json" \
  > "$OUT/logs/profile.log" 2>&1
echo "profile rc=$?"; tail -25 "$OUT/logs/profile.log"
