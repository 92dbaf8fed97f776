#!/usr/bin/env bash
# One H200 run for the Triton kernel clean-up (issue 17) and MLA on the GPU (issue 12), about 8 minutes:
#   1. the kernel test files on CUDA: Triton MHA + MLA kernels and backend, tiles, FlashInfer's MLA path
#   2. the MHA race (triton vs FlashInfer decode / fa3), compared with benchmarks/results/kernels-h200.json
#      to show the shared online-softmax helper and the per-architecture tiles slowed nothing
#   3. the MLA race: triton MLA vs FlashInfer MLA fa3 / fa2, each checked against the float oracle first
#   4. with the time left, a sweep of the Triton MLA tiles (benchmarks/sweep_triton_mla.py)
# FlashInfer's JIT builds (MLA fa3/fa2, decode, fa3 prefill) run in the background from the start.
#
# Run from the repo root with the FlashInfer wheels in .whl/ (fetch: /work/shared/tools/fetch-gpu-wheels.sh):
#   OUT=<results folder> bash benchmarks/run_h200_kernels.sh      (OUT defaults to benchmarks/results)
set -u
OUT=${OUT:-benchmarks/results}
LOGS="$OUT/logs-h200-kernels"
BUDGET=${BUDGET:-470}  # seconds for the whole run
. benchmarks/h200_env.sh
python3 benchmarks/warm_flashinfer.py mla "decode tensor" fa3 > "$LOGS/warm.log" 2>&1 &
WARM=$!

echo "== 1a. Triton kernel tests on CUDA"
timeout "$(cap 130)" python3 -m pytest -q -p no:cacheprovider tests/test_kernel_tiles.py tests/test_triton_kernels.py \
  tests/test_triton_backend.py tests/test_triton_mla.py tests/test_triton_mla_backend.py > "$LOGS/pytest-triton.log" 2>&1
echo "pytest triton rc=$?"; tail -4 "$LOGS/pytest-triton.log"

echo "== 1b. FlashInfer MLA tests on CUDA (and the CPU-side contract)"
timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider tests/test_flashinfer_backend.py -k "mla or features" \
  tests/test_flashinfer_cpu.py > "$LOGS/pytest-flashinfer-mla.log" 2>&1
echo "pytest flashinfer rc=$?"; tail -4 "$LOGS/pytest-flashinfer-mla.log"

echo "== 2. MHA race after the refactor"
timeout "$(cap 130)" python3 -m attnserve bench kernels --backends triton flashinfer flashinfer-fa3 \
  --json "$OUT/kernels-h200-after-kernel-refactor.json" > "$LOGS/bench-mha.log" 2>&1
echo "bench mha rc=$?"; tail -14 "$LOGS/bench-mha.log"
python3 benchmarks/compare_kernel_runs.py benchmarks/results/kernels-h200.json \
  "$OUT/kernels-h200-after-kernel-refactor.json" --out "$OUT/kernels-h200-refactor-compare.json" 2>&1

echo "== 3. MLA race"
timeout "$(cap 110)" python3 -m attnserve bench kernels --workloads mla \
  --backends triton flashinfer-mla-fa3 flashinfer-mla-fa2 --json "$OUT/kernels-mla-h200.json" > "$LOGS/bench-mla.log" 2>&1
echo "bench mla rc=$?"; tail -22 "$LOGS/bench-mla.log"

echo "== 4. MLA tile sweep ($(left) s left)"
if [ "$(left)" -gt 40 ]; then
  timeout "$(cap 200)" python3 benchmarks/sweep_triton_mla.py --budget-s $(( $(left) - 25 )) \
    --out "$OUT/sweep-triton-mla-h200.json" > "$LOGS/sweep-mla.log" 2>&1
  echo "sweep rc=$?"; grep -A40 '^best' "$LOGS/sweep-mla.log" | head -40
fi
kill "$WARM" 2>/dev/null
echo "== FlashInfer builds"; cat "$LOGS/warm.log"
echo "done in $(( $(date +%s) - START )) s"
