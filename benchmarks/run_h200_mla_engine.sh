#!/usr/bin/env bash
# One H200 call for DeepSeek served by the engine (issue 12, end to end), about 6 minutes:
#   1. the MLA, MoE and DeepSeek test files on CUDA (tiny DeepSeek greedy tokens equal across torch_native,
#      triton and FlashInfer MLA through the engine: tests/test_engine_gpu_mla.py)
#   2. routed experts, dense vs grouped GEMM at decode batch sizes (benchmarks/moe_gpu_paths.py)
#   3. a DeepSeek-V2-Lite-shaped random-weight model (bf16) in the engine with CUDA graphs: decode on Triton MLA
#      and on FlashInfer MLA in the same run, step time against the roofline, pages leaked
# FlashInfer's MLA JIT builds run in the background from the start.
# Run from the repo root with the FlashInfer wheels in .whl/ (fetch: /work/shared/tools/fetch-gpu-wheels.sh):
#   OUT=<results folder> bash benchmarks/run_h200_mla_engine.sh
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs-mla-engine"
BUDGET=${BUDGET:-560}
. benchmarks/h200_env.sh
(python3 benchmarks/warm_flashinfer.py "mla fa3" && python3 benchmarks/warm_flashinfer.py "mla fa2") \
  > "$LOGS/warm.log" 2>&1 &
WARM=$!

echo "== 1. MoE paths ($(left) s left)"
timeout "$(cap 60)" python3 benchmarks/moe_gpu_paths.py --out "$OUT/moe_gpu_paths.json" > "$LOGS/moe.log" 2>&1
echo "moe rc=$?"; cut -c1-220 "$LOGS/moe.log"

echo "== 2. MLA / MoE / DeepSeek tests on CUDA ($(left) s left)"
timeout "$(cap 170)" python3 -m pytest -q -p no:cacheprovider tests/test_triton_mla.py tests/test_triton_mla_backend.py \
  tests/test_mla_decode_tiles.py tests/test_models_moe.py tests/test_selection_mla.py tests/test_engine_checkpoints.py \
  > "$LOGS/pytest-mla.log" 2>&1
echo "pytest mla rc=$?"; tail -5 "$LOGS/pytest-mla.log"
wait "$WARM"; echo "FlashInfer MLA build:"; tail -2 "$LOGS/warm.log"
timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu_mla.py \
  tests/test_flashinfer_backend.py -k "mla or deepseek" > "$LOGS/pytest-engine-mla.log" 2>&1
echo "pytest engine mla rc=$?"; tail -5 "$LOGS/pytest-engine-mla.log"

echo "== 3. DeepSeek-V2-Lite in the engine ($(left) s left)"
timeout "$(cap 300)" python3 benchmarks/engine_gpu_decode.py --preset deepseek-v2-lite \
  --workloads 64x1024x128,1x1024x128 --configs triton-graphs,flashinfer-decode,flashinfer \
  --out "$OUT/engine_gpu_deepseek_v2_lite.json" > "$LOGS/decode.log" 2>&1
echo "decode rc=$?"
python3 benchmarks/engine_gpu_summary.py "$OUT/engine_gpu_deepseek_v2_lite.json"
tail -3 "$LOGS/decode.log"
echo "done in $(( $(date +%s) - START )) s"
