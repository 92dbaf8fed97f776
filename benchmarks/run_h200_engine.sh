#!/usr/bin/env bash
# One H200 call for the engine at the roofline (issue 11), about 7 minutes: the fused-ops and overlap tests
# on CUDA, the decode benchmark (overlap on/off, fused off, FlashInfer decode; 64 x 1024/256 and one request)
# and the per-kind step profile. Run from the repo root with the FlashInfer wheels in .whl/:
#   OUT=<results folder> bash benchmarks/run_h200_engine.sh
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs"
BUDGET=${BUDGET:-560}
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py "decode tensor" > "$LOGS/warm.log" 2>&1 &
echo "== tests on CUDA"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ops_kernels.py tests/test_ops_fused_model.py \
  tests/test_engine_overlap.py tests/test_engine_gpu.py tests/test_engine_cuda_graph.py > "$LOGS/pytest-engine.log" 2>&1
echo "pytest rc=$?"; tail -6 "$LOGS/pytest-engine.log"
wait
echo "== decode"
timeout 300 python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256,1x1024x256 \
  --configs triton-graphs,triton-graphs-no-overlap,triton-graphs-unfused,flashinfer-decode \
  --out "$OUT/engine_gpu_decode.json" > "$LOGS/decode.log" 2>&1
echo "decode rc=$?"; tail -30 "$LOGS/decode.log"
echo "== profile"
timeout 100 python3 benchmarks/engine_gpu_profile.py --steps 8 --modes graphs --out "$OUT/engine_gpu_profile.json" \
  > "$LOGS/profile.log" 2>&1
echo "profile rc=$?"; tail -25 "$LOGS/profile.log"
