#!/usr/bin/env bash
# The GPU runs behind the README's H200 figures, one step or several per call:
#
#   OUT=<folder> [BUDGET=560] bash benchmarks/h200.sh STEP [STEP ...]
#
# Run from the repository root. Wheels in .whl/ (FlashInfer, tvm-ffi, pytest-xdist, the server's; fetched
# beforehand, e.g. /work/shared/tools/fetch-gpu-wheels.sh --server) are installed to /tmp/site and put on
# PYTHONPATH; FlashInfer's JIT kernels for the chosen steps build in the background from the start, and a step
# that races FlashInfer waits for them. BUDGET is the whole call's seconds: every step's timeout is cut to what
# is left. Results and logs go under $OUT (default ./out); copy what a README table quotes to benchmarks/results/.
#
# Steps:
#   tests       the test suite on CUDA (pytest-xdist if carried); tests marked needs_embedded_model skip
#               themselves where the model package is absent. Skip reasons listed (-rs); the log goes to
#               benchmarks/results/logs/pytest-h200.log (TESTS_LOG) and $OUT/logs; TESTS / TEST_K narrow it
#   mha         `attnserve bench kernels`: MHA decode / prefill / extend, each contestant checked against the
#               oracle first -> kernels-h200.json + .png (MHA_BACKENDS, default triton flashinfer
#               flashinfer-fa3; MHA_WORKLOADS, default all; TRITON_OPTIONS for --triton-options)
#   mla         `attnserve bench kernels --workloads mla` -> kernels-mla-h200.json + .png (MLA_BACKENDS,
#               default triton flashinfer-mla-fa3; add flashinfer-mla-fa2 to race FlashInfer's fa2 too);
#               BENCH_ARGS adds flags to both races (--tiny for a smoke run on a CPU)
#   race        issue 36's race against the newest peers: the peer wheels (FlashInfer 0.7.x, flash-attn-4,
#               nvidia-cutlass-dsl + its libs, quack-kernels, torch-c-dlpack-ext) in the /tmp/site2 that
#               benchmarks/peer_wheels.sh stage installed over the calls just before, or from .whl/peers/ (see
#               benchmarks/README.md); fa4's GPU tests against the oracle; then
#               `bench kernels --runs 2` (L2 cold, order reversed on run 2) of MHA with triton, FlashInfer 0.6
#               here, FA4, cuDNN and flash SDPA, and FlashInfer 0.7 from /tmp/site2 in a child process, twice
#               -> kernels-race-h200-{1,2}.json + .png; RACE_WORKLOADS narrows it, RACE_MLA=1 adds the MLA race
#               (triton, FlashInfer MLA 0.6 and 0.7) -> kernels-race-mla-h200-{1,2}.json + .png; RACE_MHA=0 leaves
#               out fa4's tests and the MHA races (with RACE_MLA=1: the MLA race alone, its kernels warmed instead);
#               RACES (default 2) races of each kind. With PEER_SET=fa4's two stage calls /tmp/site2 holds FA4 alone:
#               the race then takes FA4 from it and FlashInfer only as the 0.6 of .whl (no child process)
#               On an H100 (2026-12-05) the JIT builds took ~150 s, fa4's tests 50 s, one MHA race ~100 s: the MHA
#               races fill one call (BUDGET=590) and the MLA race wants a call of its own. With PEER_SET=fa4 on a
#               machine a `tests` call left warm (FlashInfer's JIT cache built), RACES=1 took 112 s in all (2026-12-06)
#   switches    the Gluon prefill's schedules built behind module switches (PREFILL_SWITCHES, default
#               DYNAMIC_ITEMS=1), each checked against the oracle first in a child process with a time limit (a hang
#               costs that limit, not the call), then those that pass raced against the shipped kernel, 7 rounds,
#               the order reversed every other round, the shipped kernel timed twice (READ_POOL_ROWS=1) as the noise
#               control -> sweep-prefill-gluon-switches-h200.json. Needs no wheels; on an H100 (2026-12-06) about
#               45 s a sweep of four candidates, 100 s with the checks
#   mla-switches
#               the Gluon MLA launch's switches (MLA_SWITCHES, default SEESAW_PAGES_AHEAD=1 SEESAW_WHOLE_TILES=1), each
#               checked against the oracle first in a child process with a time limit (the scorer's decode over 1- and
#               16-token pages, the seesaw's extend rows over 1- and 64-token pages), then those that pass raced against
#               the shipped kernels on every MLA race workload, SWITCH_ROUNDS (default 5) rounds, the order reversed
#               every other round; workloads a switch does not touch time the noise -> sweep-mla-switches-h200.json.
#               Needs no wheels; WARM_FLASHINFER=0 leaves FlashInfer's JIT builds out of a call that races no peer
#   prefill-ncu Nsight Compute on every kernel of one call of each contestant (benchmarks/prefill_ncu.py: pipes busy,
#               stall reasons, DRAM bytes) -> ncu-h200-<workload>.json; MHA: triton, FA4 (from the /tmp/site2 that
#               benchmarks/peer_wheels.sh stage put it in), FlashInfer fa3 and cuDNN on fresh prompts; MLA: triton and
#               FlashInfer MLA fa3. NCU_WORKLOADS: workload names, comma-separated (default: the four MHA prefill and
#               extend cases; NCU_WORKLOADS=mla: the MLA ones under 1.0x). On an H100 (2026-12-06) three MHA
#               workloads took 290 s with FlashInfer's JIT build (about 80 s), the four MLA ones 160 s
#   engine      engine_gpu_decode.py, Llama-3-8B shape, 64 x 1024/256 and 1 x 1024/256: PDL on, overlap off, fused
#               ops off, FlashInfer decode -> engine_gpu_decode.json; then the step profile ->
#               engine_gpu_profile.json
#   engine-mla  engine_gpu_decode.py, DeepSeek-V2-Lite shape on triton (PDL off and on) and FlashInfer MLA ->
#               engine_gpu_deepseek_v2_lite.json
#   engine-profiles
#               engine_gpu_profile.py, triton, graphs and fused ops, at batch 1 and 64 for Llama-3-8B and DeepSeek-V2-Lite
#               shapes (PROFILE_PRESETS, PROFILE_BATCHES): each decode step split into gemm / attention / elementwise /
#               other kernels and the host gap, the top kernels by name -> engine_gpu_profile_{preset}_b{N}.json
#               (the profile issue 49 starts from; PROFILE_FUSED, default on,pdl: the fused ops plain and with
#               --enable-pdl; PROFILE_ARGS adds flags, e.g. --device cpu --preset smollm2-135m)
#   engine-ab   engine_gpu_profile.py, DeepSeek-V2-Lite shape at batch 1 and 64: the fused ops, with PDL, and each
#               fusion left out (AB_FUSED) -> engine_ab_deepseek_b{N}.json; with a .before/ tree carried (as for
#               race_before_after.sh: git archive REV src benchmarks), that tree's fused step in the same call ->
#               engine_ab_deepseek_b{N}_before.json
#   gemm        gemm_skinny_gpu.py: the skinny GEMM candidate (ops/kernels/skinny_gemm.py) against cuBLAS at the
#               Llama-3-8B decode projections, M = 1 and 64, a sweep of its configs, and a decode step's projections
#               summed both ways -> gemm-skinny-h200.json (GEMM_ARGS adds flags; --quick: defaults only)
#   moe         moe_gpu_paths.py: routed experts, dense against grouped GEMM -> moe_gpu_paths.json
#   training    training_h200.py: the sweep of the forward path and the backward's tiles, then the differentiable
#               FlashAttention's forward and backward against SDPA's flash and cuDNN, and FA4 where
#               benchmarks/peer_wheels.sh stage left it in /tmp/site2 (PEER_SET=fa4: two stage calls, the second
#               this one), then Nsight Compute's DRAM bytes against the traffic model (a few minutes)
#               -> training-h200.json; TRAINING_ARGS adds flags (e.g. --no-ncu; --device cpu with tiny shapes
#               checks the script here)
#   serve       `attnserve bench serve` against transformers serve and the offline engine -> serve-h200.{json,md}
#               (knobs: MODEL_DIR, IN_LEN, OUT_LEN; PEER_DEVICE=cpu MODEL_ARGS=--tiny for a CPU smoke run)
#   serve-waves serve_h200_waves.sh: three waves of 64 streams (after 64 warm-up) on the one-process server and
#               on --api-workers 2, default budget, 1024/256; fails when a request is cut or failed ->
#               serve-waves.{json,md,png} (about 4 minutes; needs the server wheels in .whl)
#   serve-profile
#               serve_profile.sh: the budget sweep's server (default budget, --api-workers 2), one warm-up wave, then
#               py-spy samples the engine process through c=64 x 200 requests -> serve-profile/{top.txt, engine.txt,
#               bench.json} (about 2 minutes; py-spy from .whl)
#   budget-offline
#               serve_h200_budget.py offline: the step token budget (--max-num-batched-tokens auto, off, 512, 2048,
#               1024, 256, auto:32768, auto:131072) on the offline engine, one model and one engine for all, 2 waves
#               of 64 x 1024/256 each: tok/s, ITL p50/p99/max, TTFT, the mixed steps, and the fitted cost of a mixed
#               step against a decode step -> serve-budget/offline.json (+ the merged serve-budget.{json,md},
#               budget.png); about 3 minutes, no FlashInfer needed
#   budget-profile
#               engine_gpu_profile.py --modes none --mixed-chunks ...: one mixed step of 64 decodes + N prompt
#               tokens (N = 2 ... 8192), the triton backend's split on and off, wall / kernels by kind / host gap
#               against the decode step, the line wall = a + b * N, and the host's top functions (cProfile) in a
#               step of N = 256 -> engine_gpu_profile_mixed.json; then the same steps (N <= 2048, split on) in
#               piecewise CUDA graphs -> engine_gpu_profile_mixed_piecewise.json (~5 minutes)
#   budget-served
#               serve_h200_budget.py served: the server (--api-workers 2) at the default budget and with it off, c=64,
#               200 requests each, beside serve-budget/offline.json when OUT has it (OFFLINE_JSON= names an earlier
#               one) -> serve-budget/served.json + the merged record (about 3.5 minutes)
#   budget-poisson
#               serve_h200_budget.py poisson: the default budget at Poisson rates 4/8/12/16 with goodput under
#               TTFT p99 <= 1 s, ITL p99 <= 50 ms -> serve-budget/poisson.json + the merged record (about 3 minutes)
#   budget-c1   serve_h200_budget.py c1: one stream at the default budget, served TPOT (c=1, 8 requests) against the
#               offline engine's decode step at batch 1 (target <= 1.02x) -> serve-budget/c1.json + the merged record
#               (about 2.5 minutes)
#   serve-budget
#               the three budget steps in a row (about 10 minutes: more than one call; run them one a call)
#               BUDGET_ARGS adds flags to the three (--quick: the CPU dry run), PROFILE_ARGS to budget-profile
#               (e.g. --device cpu --preset smollm2-135m --requests 2 --input-len 32 --steps 1 --mixed-chunks 2,16)
#   tune        `attnserve tune --model llama-3-8b` and the selection trace citing it -> tune-h200-llama-3-8b.*
#   tp          tp 1 through the tensor-parallel path against the plain engine, both orders -> tp_gpu_tp1.json
#   spec        spec_h200.py, Llama-3-8B shape: the verify step (K = 2, 4, 8 drafts; batch 1, 8, 64) against a
#               decode step, graphed, and batch-1 tok/s with drafts forced to the greedy continuation
#               -> spec-h200.json
#   compare BEFORE.json AFTER.json
#               two `bench kernels` runs: after / before per case and backend (`attnserve bench compare`,
#               exit 3 past REGRESSION_THRESHOLD, default 0.10), and each case's triton time over the best
#               other backend of the same run, before and after (what moves between leases cancels there)
#
# e.g. OUT=$OUT bash benchmarks/h200.sh mha mla engine   (with .whl carried: about 7 minutes)
#      OUT=$OUT bash benchmarks/h200.sh budget-offline budget-profile   (about 5 minutes; then budget-served, then
#      budget-poisson, one call each; `python3 benchmarks/serve_h200_budget.py report DIR` merges them anywhere)
set -u
usage() { awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; }  # the comment block above
STEPS=()
COMPARE=()
while [ $# -gt 0 ]; do
  case "$1" in
    compare) [ $# -ge 3 ] || { echo "compare needs BEFORE.json AFTER.json" >&2; exit 2; }
             COMPARE=("$2" "$3"); STEPS+=(compare); shift 3 ;;
    tests|mha|mla|race|switches|mla-switches|prefill-ncu|engine|engine-mla|engine-profiles|engine-ab|gemm|moe|training|serve|tune|tp|spec) STEPS+=("$1"); shift ;;
    serve-waves|serve-profile|budget-offline|budget-profile|budget-served|budget-poisson|budget-c1) STEPS+=("$1"); shift ;;
    serve-budget) STEPS+=(budget-offline budget-served budget-poisson); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown step: $1 (see: bash benchmarks/h200.sh --help)" >&2; exit 2 ;;
  esac
done
[ ${#STEPS[@]} -gt 0 ] || { usage; exit 2; }
has() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

OUT=${OUT:-out}
LOGS="$OUT/logs"
BUDGET=${BUDGET:-560}
mkdir -p "$OUT" "$LOGS"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 5 ? l : 5 )) || echo "$1"; }
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16

step_compare() {
  local before=${COMPARE[0]} after=${COMPARE[1]}
  echo "== compare: $after against $before"
  python3 -m attnserve bench compare --regression-threshold "${REGRESSION_THRESHOLD:-0.10}" "$after" "$before"
  local rc=$?
  python3 - "$before" "$after" <<'PY'
import json, sys

def times(path):
    out = {}
    for r in json.load(open(path))["records"]:
        if "us" in r:
            out.setdefault(r["workload"], {})[r["backend"]] = r["us"]
    return out

# each case against the backend that was fastest beside triton in the run before, where both runs have it
before, after = times(sys.argv[1]), times(sys.argv[2])
print(f"{'case':<28} {'peer':<20} {'triton / peer before':>21} {'after':>7} {'after / before':>15}")
for workload, b in before.items():
    a = after.get(workload, {})
    peers = {k: us for k, us in b.items() if k != "triton" and k in a}
    if "triton" not in b or "triton" not in a or not peers:
        continue
    peer = min(peers, key=peers.get)
    rb, ra = b["triton"] / b[peer], a["triton"] / a[peer]
    print(f"{workload:<28} {peer:<20} {rb:>21.3f} {ra:>7.3f} {ra / rb:>14.3f}x")
PY
  return $rc
}

# compare alone needs no GPU; on the GPU machine the CLI's own dependencies are in /tmp/site from an earlier step
if [ "${STEPS[*]}" = compare ]; then
  [ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
  step_compare; exit $?
fi

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.total --format=csv \
  > "$LOGS/smi.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$LOGS/pip.log" 2>&1 \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
else
  echo "no .whl/ carried: FlashInfer (and the server's packages) only if the machine has them"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tee "$LOGS/versions.txt"

MHA_BACKENDS=${MHA_BACKENDS:-triton flashinfer flashinfer-fa3}
MLA_BACKENDS=${MLA_BACKENDS:-triton flashinfer-mla-fa3}

# FlashInfer's JIT kernels the chosen steps race, in step order, built in one background process
WARM=()
has tests && WARM+=("mla fa3" "decode tensor" "prefill fa3" "extend fa3" "extend fa2")  # fa2: the verify graphs
has mha && WARM+=("decode tensor" "prefill fa3" "extend fa3")
has prefill-ncu && WARM+=("prefill fa3" "extend fa3" "mla fa3")
if has race; then
  [ "${RACE_MHA:-1}" = 1 ] && WARM+=("decode tensor" "prefill fa3" "extend fa3")
  [ "${RACE_MLA:-0}" = 1 ] && WARM+=("mla fa3")
fi
has mla && WARM+=("mla fa3") && case " $MLA_BACKENDS " in *" flashinfer-mla-fa2 "*) WARM+=("mla fa2") ;; esac
has engine && WARM+=("decode tensor")
has engine-mla && WARM+=("mla fa3" "mla fa2")
has serve && WARM+=("decode tensor" "prefill fa3" "extend fa3")
has tune && WARM+=("decode tensor" "fa3")
WARM_PID=""
if [ ${#WARM[@]} -gt 0 ] && [ "${WARM_FLASHINFER:-1}" = 1 ] && python3 -c "import flashinfer" 2> /dev/null; then
  timeout "$(cap 400)" nice -n 19 python3 benchmarks/warm_flashinfer.py "${WARM[@]}" > "$LOGS/warm-flashinfer.log" 2>&1 &
  WARM_PID=$!
fi
wait_warm() {
  [ -n "$WARM_PID" ] || return 0
  wait "$WARM_PID" 2> /dev/null; WARM_PID=""
  echo "FlashInfer builds:"; cat "$LOGS/warm-flashinfer.log"
}

step_tests() {
  echo "== tests on CUDA ($(left) s left)"
  local workers tests rc log=${TESTS_LOG:-benchmarks/results/logs/pytest-h200.log}
  # worksteal: idle workers take tests queued on busy ones, so the slow GPU tests (JIT builds) do not make the tail
  workers=$(python3 -c "import xdist" 2> /dev/null && echo "-n ${TEST_WORKERS:-16} --dist worksteal")
  # tests that load the embedded model (absent here: its package does not travel) skip themselves with the
  # reason, by their needs_embedded_model marker (tests/conftest.py); -rs lists every skip and why
  tests=${TESTS:-tests}
  mkdir -p "$(dirname "$log")"
  # SIGINT at the cap: pytest still prints which tests failed and the slowest ones; -v names each as it ends
  # shellcheck disable=SC2086
  timeout -s INT -k 30 "$(cap "${TESTS_S:-500}")" python3 -m pytest -v -rfEs --durations=25 -p no:cacheprovider \
    $workers $tests ${TEST_K:+-k "$TEST_K"} > "$log" 2>&1
  rc=$?
  cp "$log" "$LOGS/pytest.log"  # and with the call's other logs under $OUT
  echo "pytest rc=$rc (log: $log)"; grep -E "^(FAILED|ERROR)" "$log" | cut -c1-300 | head -40
  grep -A27 "slowest 25 durations" "$log" | cut -c1-200
  echo "skipped, by reason:"
  grep -E "^SKIPPED \[" "$log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^ ]+: /\1 /' \
    | awk '{n = $1; $1 = ""; count[$0] += n} END {for (r in count) printf "%6d %s\n", count[r], r}' | sort -rn | head -20
  tail -1 "$log"
}

step_mha() {
  wait_warm
  echo "== MHA kernel race ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 150)" python3 -m attnserve bench kernels ${MHA_WORKLOADS:+--workloads $MHA_WORKLOADS} \
    --backends $MHA_BACKENDS ${TRITON_OPTIONS:+--triton-options "$TRITON_OPTIONS"} ${BENCH_ARGS:-} \
    --json "$OUT/kernels-h200.json" --png "$OUT/kernels-h200.png" > "$LOGS/bench-mha.log" 2>&1
  echo "bench mha rc=$?"; grep -A12 '^results' "$LOGS/bench-mha.log"; grep ' / ' "$LOGS/bench-mha.log"
}

step_mla() {
  wait_warm
  echo "== MLA kernel race ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 150)" python3 -m attnserve bench kernels --workloads mla --backends $MLA_BACKENDS \
    ${TRITON_OPTIONS:+--triton-options "$TRITON_OPTIONS"} ${BENCH_ARGS:-} \
    --json "$OUT/kernels-mla-h200.json" --png "$OUT/kernels-mla-h200.png" > "$LOGS/bench-mla.log" 2>&1
  echo "bench mla rc=$?"; grep -A12 '^results' "$LOGS/bench-mla.log"; grep ' / ' "$LOGS/bench-mla.log"
}

# The peers at their newest: FlashInfer 0.7.x cannot load next to the 0.6.x in /tmp/site, so its wheels and FA4's
# go to /tmp/site2, which only the fa4 tests and the race's child process (--peer-site) put first on PYTHONPATH.
# FA4 itself is raced from /tmp/site2 too: flash-attn-4 and the CuTe DSL import nothing of FlashInfer's, so the
# main process gets /tmp/site2 after /tmp/site (its FlashInfer 0.6 stays the one imported there).
# The CuTe DSL's wheel puts its packages on sys.path through a .pth file, which Python reads in site-packages but
# not in a PYTHONPATH folder such as /tmp/site2: SITE2_PATH names that folder too.
SITE2=/tmp/site2
SITE2_PATH=$SITE2:$SITE2/nvidia_cutlass_dsl/dsl_packages
install_peers() {
  if [ -f "$SITE2/.peer-set" ]; then
    echo "peers: the $SITE2 that benchmarks/peer_wheels.sh stage installed (set $(cat "$SITE2/.peer-set"))"
  elif ls .whl/peers/*.whl > /dev/null 2>&1; then
    echo "peers: .whl/peers/*.whl -> $SITE2"
    [ -d "$SITE2" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE2" .whl/peers/*.whl \
      > "$LOGS/pip-peers.log" 2>&1 || { echo "peer wheels failed to install:"; tail -5 "$LOGS/pip-peers.log"; return 1; }
  else
    echo "no $SITE2 from benchmarks/peer_wheels.sh stage (a cold machine starts bare) and no .whl/peers/ carried:" \
      "FA4 and FlashInfer 0.7 are not raced"; return 1
  fi
  PYTHONPATH=$SITE2_PATH:$PYTHONPATH python3 -c "import flashinfer, flash_attn.cute.interface as f; print('site2: flashinfer', flashinfer.__version__, 'fa4 ok')" \
    2>&1 | tee "$LOGS/versions-site2.txt"
}

step_race() {
  local i runs_ok=0 want=0 mha=${RACE_MHA:-1} mla=${RACE_MLA:-0} site2_warm=() mha_peer=() mla_peer=() warm2=""
  wait_warm
  install_peers || return 1
  [ "$mha" = 1 ] && site2_warm+=("decode tensor" "prefill fa3" "extend fa3")
  [ "$mla" = 1 ] && site2_warm+=("mla fa3")
  [ ${#site2_warm[@]} -gt 0 ] || { echo "RACE_MHA=0 without RACE_MLA=1: nothing to race"; return 1; }
  if [ -d "$SITE2/flashinfer" ]; then
    mha_peer=(--peer-site "$SITE2" --peer-backends flashinfer flashinfer-fa3)
    mla_peer=(--peer-site "$SITE2" --peer-backends flashinfer-mla-fa3)
    # FlashInfer 0.7's JIT kernels build in the background while FA4's tests run (its own cache per version)
    PYTHONPATH=$SITE2_PATH:$PYTHONPATH timeout "$(cap 300)" nice -n 19 python3 benchmarks/warm_flashinfer.py \
      "${site2_warm[@]}" > "$LOGS/warm-flashinfer-site2.log" 2>&1 &
    warm2=$!
  else
    echo "$SITE2 holds no FlashInfer (PEER_SET=fa4): FA4 races, FlashInfer only as the 0.6 of .whl" \
      > "$LOGS/warm-flashinfer-site2.log"
  fi
  if [ "$mha" = 1 ]; then
    echo "== fa4 against the oracle ($(left) s left)"
    PYTHONPATH=$PYTHONPATH:$SITE2_PATH timeout "$(cap 120)" python3 -m pytest -q -p no:cacheprovider tests/test_fa4_backend.py \
      > "$LOGS/pytest-fa4.log" 2>&1
    echo "fa4 tests rc=$?"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest-fa4.log" | cut -c1-300 | head -20; tail -1 "$LOGS/pytest-fa4.log"
  fi
  [ -n "$warm2" ] && wait "$warm2" 2> /dev/null; echo "FlashInfer 0.7 builds:"; cat "$LOGS/warm-flashinfer-site2.log"
  if [ "$mha" = 1 ]; then
    want=$((want + ${RACES:-2}))
    for i in $(seq 1 "${RACES:-2}"); do
      echo "== race $i of ${RACES:-2} against the newest peers ($(left) s left)"
      # shellcheck disable=SC2086
      PYTHONPATH=$PYTHONPATH:$SITE2_PATH timeout "$(cap 200)" python3 -m attnserve bench kernels --runs 2 \
        ${RACE_WORKLOADS:+--workloads $RACE_WORKLOADS} \
        --backends triton flashinfer flashinfer-fa3 fa4 sdpa-cudnn sdpa-flash \
        "${mha_peer[@]}" ${TRITON_OPTIONS:+--triton-options "$TRITON_OPTIONS"} \
        ${BENCH_ARGS:-} --json "$OUT/kernels-race-h200-$i.json" --png "$OUT/kernels-race-h200-$i.png" \
        > "$LOGS/bench-race-$i.log" 2>&1
      echo "race $i rc=$?"; grep -A40 '^results' "$LOGS/bench-race-$i.log" | cut -c1-200; grep ' / ' "$LOGS/bench-race-$i.log"
      [ -f "$OUT/kernels-race-h200-$i.json" ] && runs_ok=$((runs_ok + 1))
    done
  fi
  if [ "$mla" = 1 ]; then
    want=$((want + ${RACES:-2}))
    for i in $(seq 1 "${RACES:-2}"); do
      echo "== MLA race $i of ${RACES:-2} ($(left) s left)"
      # shellcheck disable=SC2086
      PYTHONPATH=$PYTHONPATH:$SITE2_PATH timeout "$(cap 150)" python3 -m attnserve bench kernels --runs 2 --workloads mla \
        --backends triton flashinfer-mla-fa3 "${mla_peer[@]}" \
        ${BENCH_ARGS:-} --json "$OUT/kernels-race-mla-h200-$i.json" --png "$OUT/kernels-race-mla-h200-$i.png" \
        > "$LOGS/bench-race-mla-$i.log" 2>&1
      echo "MLA race $i rc=$?"; grep ' / ' "$LOGS/bench-race-mla-$i.log"
      [ -f "$OUT/kernels-race-mla-h200-$i.json" ] && runs_ok=$((runs_ok + 1))
    done
  fi
  [ "$runs_ok" = "$want" ]
}

NCU_MHA="prefill 8x2048,prefill 1x16384,prefill 32x512,extend 8x(4096+512)"
NCU_MLA="mla decode 128x4096 h128 p1,mla decode 64x8192 h128 p64,mla extend 8x(4096+512) h128 p1,mla extend 8x(4096+512) h16 p64"
step_switches() {
  local sw candidates="--gluon-set READ_POOL_ROWS=1"
  for sw in ${PREFILL_SWITCHES-DYNAMIC_ITEMS=1}; do
    echo "== check $sw against the oracle ($(left) s left)"
    PYTHONPATH=$PYTHONPATH:$PWD/tests timeout "$(cap 90)" python3 -c "import test_prefill_gluon as t
e = max(t.check_switched('$sw', False), t.check_switched('$sw', True)); print('$sw: relative error', e); assert e < 1e-2" \
      > "$LOGS/check-${sw//[=,]/_}.log" 2>&1 && candidates="$candidates --gluon-set $sw"
    tail -2 "$LOGS/check-${sw//[=,]/_}.log"
  done
  echo "== prefill: $candidates ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 230)" python3 tools/sweep_prefill_tma.py --gluon --default-only --workloads 8x2048 1x16384 extend \
    --prefills 4x4096 --rounds "${SWITCH_ROUNDS:-7}" $candidates --budget-s "$(( $(cap 230) - 25 ))" \
    --out "$OUT/sweep-prefill-gluon-switches-h200.json" > "$LOGS/switches-prefill.log" 2>&1
  grep "median\|FAIL\|budget" "$LOGS/switches-prefill.log"
}

step_mla_switches() {
  local sw candidates=""
  for sw in ${MLA_SWITCHES-SEESAW_PAGES_AHEAD=1 SEESAW_WHOLE_TILES=1}; do
    echo "== check $sw against the oracle, decode and extend rows ($(left) s left)"
    PYTHONPATH=$PYTHONPATH:$PWD/tests timeout "$(cap 150)" python3 -c "import test_gluon_mla as t
e = max(t.check_scorer_switched('$sw', 1), t.check_scorer_switched('$sw', 16), t.check_extend_rows_switched('$sw', 1),
        t.check_extend_rows_switched('$sw', 64)); print('$sw: relative error', e); assert e < 1e-2" \
      > "$LOGS/check-${sw//[=,]/_}.log" 2>&1 && candidates="$candidates --gluon-set $sw"
    tail -2 "$LOGS/check-${sw//[=,]/_}.log" | cut -c1-300
  done
  [ -n "$candidates" ] || { echo "no MLA switch passed its check: nothing to race"; return 1; }
  echo "== MLA:$candidates ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 300)" python3 tools/sweep_triton_mla.py $candidates --rounds "${SWITCH_ROUNDS:-5}" \
    --budget-s "$(( $(cap 300) - 40 ))" --out "$OUT/sweep-mla-switches-h200.json" > "$LOGS/switches-mla.log" 2>&1
  grep "median\|budget\|rror" "$LOGS/switches-mla.log" | cut -c1-200
}

step_prefill_ncu() {
  local w workloads path=$PYTHONPATH rc=0
  wait_warm
  [ -f "$SITE2/.peer-set" ] && path=$PYTHONPATH:$SITE2_PATH
  workloads=${NCU_WORKLOADS:-$NCU_MHA}
  [ "$workloads" = mla ] && workloads=$NCU_MLA
  local IFS=,
  for w in $workloads; do
    local tag=${w// /-}; tag=${tag//[()+]/}
    echo "== ncu, $w ($(left) s left)"
    PYTHONPATH=$path timeout "$(cap 300)" python3 benchmarks/prefill_ncu.py --workload "$w" \
      --timeout-s 120 --out "$OUT/ncu-h200-$tag.json" > "$LOGS/ncu-$tag.log" 2>&1 || rc=$?
    cut -c1-600 "$LOGS/ncu-$tag.log" | tail -8
  done
  return $rc
}

step_engine() {
  wait_warm
  echo "== engine decode ($(left) s left)"
  timeout "$(cap 300)" python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256,1x1024x256 \
    --configs triton-graphs,triton-graphs-pdl,triton-graphs-no-overlap,triton-graphs-unfused,flashinfer-decode \
    --out "$OUT/engine_gpu_decode.json" > "$LOGS/decode.log" 2>&1
  echo "decode rc=$?"; tail -30 "$LOGS/decode.log"
  echo "== engine step profile ($(left) s left)"
  timeout "$(cap 100)" python3 benchmarks/engine_gpu_profile.py --steps 8 --modes graphs \
    --out "$OUT/engine_gpu_profile.json" > "$LOGS/profile.log" 2>&1
  echo "profile rc=$?"; tail -25 "$LOGS/profile.log"
}

step_spec() {
  echo "== speculative verify and forced acceptance ($(left) s left)"
  timeout "$(cap 240)" python3 benchmarks/spec_h200.py --out "$OUT/spec-h200.json" > "$LOGS/spec.log" 2>&1
  echo "spec rc=$?"; tail -25 "$LOGS/spec.log"
}

step_engine_mla() {
  wait_warm
  echo "== DeepSeek-V2-Lite in the engine ($(left) s left)"
  timeout "$(cap 300)" python3 benchmarks/engine_gpu_decode.py --preset deepseek-v2-lite \
    --workloads 64x1024x128,1x1024x128 --configs triton-graphs,triton-graphs-pdl,flashinfer-decode,flashinfer \
    --out "$OUT/engine_gpu_deepseek_v2_lite.json" > "$LOGS/decode-deepseek.log" 2>&1
  echo "decode rc=$?"; tail -12 "$LOGS/decode-deepseek.log"
}

step_engine_profiles() {
  local preset n rc=0
  wait_warm
  for preset in ${PROFILE_PRESETS:-llama-3-8b deepseek-v2-lite}; do
    for n in ${PROFILE_BATCHES:-1 64}; do
      echo "== decode step profile: $preset, batch $n ($(left) s left)"
      # shellcheck disable=SC2086
      timeout "$(cap 120)" python3 benchmarks/engine_gpu_profile.py --preset "$preset" --requests "$n" --steps 8 --attention-backend triton \
        --modes graphs --fused "${PROFILE_FUSED:-on,pdl}" --top 40 ${PROFILE_ARGS:-} --out "$OUT/engine_gpu_profile_${preset}_b$n.json" \
        > "$LOGS/profile-$preset-b$n.log" 2>&1 || rc=$?
      grep -v -E '^(\{|USDT)' "$LOGS/profile-$preset-b$n.log" | tail -4
    done
  done
  return $rc
}

step_engine_ab() {
  local n rc=0
  wait_warm
  for n in ${AB_BATCHES:-1 64}; do
    if [ -d .before/src ]; then
      echo "== the .before tree, DeepSeek-V2-Lite batch $n ($(left) s left)"
      PYTHONPATH=.before/src:/tmp/site timeout "$(cap 60)" python3 .before/benchmarks/engine_gpu_profile.py \
        --preset deepseek-v2-lite --requests "$n" --steps 8 --attention-backend triton --modes graphs --fused on --top 40 \
        --out "$OUT/engine_ab_deepseek_b${n}_before.json" > "$LOGS/ab-before-b$n.log" 2>&1 || rc=$?
      grep -E '^(mode|graphs)' "$LOGS/ab-before-b$n.log"
    fi
    echo "== fusions one by one, DeepSeek-V2-Lite batch $n ($(left) s left)"
    timeout "$(cap 200)" python3 benchmarks/engine_gpu_profile.py --preset deepseek-v2-lite --requests "$n" --steps 8 \
      --attention-backend triton --modes graphs --fused "${AB_FUSED:-on,pdl,no-mla_absorb_rope,no-moe_route}" --top 40 \
      --out "$OUT/engine_ab_deepseek_b$n.json" > "$LOGS/ab-b$n.log" 2>&1 || rc=$?
    grep -E '^(mode|graphs)' "$LOGS/ab-b$n.log"
  done
  return $rc
}

step_gemm() {
  echo "== skinny GEMM against cuBLAS ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 360)" python3 benchmarks/gemm_skinny_gpu.py --out "$OUT/gemm-skinny-h200.json" ${GEMM_ARGS:-} \
    > "$LOGS/gemm.log" 2>&1
  local rc=$?
  echo "gemm rc=$rc"; cut -c1-260 "$LOGS/gemm.log" | tail -24
  return $rc
}

step_training() {
  local path=$PYTHONPATH
  if [ -f "$SITE2/.peer-set" ]; then
    path=$PYTHONPATH:$SITE2_PATH; echo "FA4 from $SITE2 races too"
  else
    echo "no $SITE2 (benchmarks/peer_wheels.sh stage): FA4 is not raced"
  fi
  echo "== training attention ($(left) s left)"
  # shellcheck disable=SC2086
  PYTHONPATH=$path timeout "$(cap 420)" python3 benchmarks/training_h200.py --out "$OUT/training-h200.json" \
    ${TRAINING_ARGS:-} > "$LOGS/training.log" 2>&1
  local rc=$?
  echo "training rc=$rc"; grep -v '^sweep {' "$LOGS/training.log" | cut -c1-400 | tail -24
  return $rc
}

step_moe() {
  echo "== MoE paths ($(left) s left)"
  timeout "$(cap 60)" python3 benchmarks/moe_gpu_paths.py --out "$OUT/moe_gpu_paths.json" > "$LOGS/moe.log" 2>&1
  echo "moe rc=$?"; cut -c1-220 "$LOGS/moe.log"
}

# The serving run: a Llama-3-8B-shaped model directory (random bf16 weights, word-level tokenizer); the offline
# engine on the same shapes (the targets), and with one request; `attnserve bench serve` launching our server with
# --attention-backend triton and --decode-attention-backend flashinfer; the same sweep with --url against
# `transformers serve --continuous-batching` on the same directory, a time budget per point; our server with the
# default selection last (its fa3 prefill kernels have finished building by then); serve_h200_report.py merges
# them into serve-h200.{json,md} with the targets. Every phase has a deadline, so the report is always written,
# saying what did not run. Sized for about 8 minutes of a 10-minute call.
step_serve() {
  local MODEL_DIR=${MODEL_DIR:-/tmp/llama3-8b-random} PEER_DEVICE=${PEER_DEVICE:-cuda} MODEL_ARGS=${MODEL_ARGS:-}
  local IN_LEN=${IN_LEN:-1024} OUT_LEN=${OUT_LEN:-256} NOTES=() SWEEP OURS PEER_S PORT PEER_PID POINT_S ARGS n
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  python3 -m pip list --path /tmp/site 2> /dev/null > "$OUT/versions-carried.txt"
  python3 -m pip list 2> /dev/null | grep -i -E "^(torch|triton|transformers|aiohttp) " > "$OUT/versions.txt"

  echo "[$(left) s left] model directory"
  # shellcheck disable=SC2086
  timeout "$(cap 150)" python3 benchmarks/serve_h200_model.py "$MODEL_DIR" $MODEL_ARGS > "$LOGS/model.log" 2>&1
  echo "model rc=$?"; tail -2 "$LOGS/model.log"

  echo "[$(left) s left] offline engine"
  timeout "$(cap 100)" python3 benchmarks/engine_gpu_decode.py --configs triton-graphs,flashinfer-decode \
    --workloads "64x${IN_LEN}x${OUT_LEN}" --out "$OUT/engine-offline.json" > "$LOGS/offline.log" 2>&1
  echo "offline rc=$?"; tail -3 "$LOGS/offline.log"
  # one request alone: the engine's own batch-1 decode step, to split c=1 TPOT into engine and server time
  timeout "$(cap 45)" python3 benchmarks/engine_gpu_decode.py --configs triton-graphs --workloads "1x${IN_LEN}x${OUT_LEN}" \
    --out "$OUT/engine-offline-c1.json" > "$LOGS/offline-c1.log" 2>&1
  echo "offline c=1 rc=$?"

  # Shared by ours and the peer: seeds 3 at c=1 and c=8, 1 at c=32 and c=64; one wave of requests per point
  # (Nx = N per client) except 2 per client at c=1.
  SWEEP=(--dataset random --input-len "$IN_LEN" --output-len "$OUT_LEN" --tokenizer "$MODEL_DIR" --concurrency 1,8,32,64
         --no-progress --server-log-dir "$LOGS")
  OURS=("${SWEEP[@]}" --seeds 3,3,1,1 --num-prompts 2x,1x,1x,200 --warmup-requests 64 --title "attnserve serve"
        --launch "--model $MODEL_DIR --random-weights --chunked-prefill-size 8192 --disable-radix-cache --max-running-requests 64")
  NOTES+=("reduced to fit one 10-minute GPU call: seeds 3 at concurrency 1 and 8 and 1 at 32 and 64; prompts per point and seed 2 at c=1, one wave (= concurrency) at 8 and 32, 200 at 64; 64 warm-up requests per server")
  NOTES+=("our servers load $MODEL_DIR with --random-weights (its config and tokenizer, weights drawn on the GPU: same shapes, no 16 GB read per launch); the peer loads the directory's safetensors")
  NOTES+=("engine settings as in the offline run: --chunked-prefill-size 8192 --disable-radix-cache --max-running-requests 64")

  echo "[$(left) s left] attnserve bench serve: triton, flashinfer decode"
  timeout "$(cap 200)" python3 -m attnserve bench serve "${OURS[@]}" \
    --compare "triton=--attention-backend triton" "flashinfer-decode=--decode-attention-backend flashinfer" \
    --json "$OUT/ours-a.json" > "$LOGS/ours-a.log" 2>&1
  echo "ours rc=$?"; grep "^|" "$LOGS/ours-a.log" | tail -9

  PEER_S=$(left)
  if [ "$PEER_S" -gt 150 ]; then
    echo "[$PEER_S s left] peer: transformers serve --continuous-batching"
    PORT=8011
    python3 -m transformers.cli.transformers serve "$MODEL_DIR" --continuous-batching --device "$PEER_DEVICE" \
      --dtype bfloat16 --host 127.0.0.1 --port $PORT > "$LOGS/peer.log" 2>&1 &
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
      > "$LOGS/peer-bench.log" 2>&1
    echo "peer bench rc=$?"; grep "^|" "$LOGS/peer-bench.log" | tail -5
    kill "$PEER_PID" 2> /dev/null; sleep 3; kill -9 "$PEER_PID" 2> /dev/null
  else
    NOTES+=("the peer was not run: only $PEER_S s of the call's budget were left after our first sweep")
  fi

  echo "[$(left) s left] attnserve bench serve: default selection"
  tail -3 "$LOGS/warm-flashinfer.log" 2> /dev/null
  timeout "$(cap 150)" python3 -m attnserve bench serve "${OURS[@]}" --compare "default=" \
    --json "$OUT/ours-b.json" > "$LOGS/ours-b.log" 2>&1
  echo "default rc=$?"; grep "^|" "$LOGS/ours-b.log" | tail -5

  NOTES+=("FlashInfer JIT builds in the background (nice 19) during the first phases: $(grep -E 'built in|failed after' \
    "$LOGS/warm-flashinfer.log" 2> /dev/null | cut -c1-80 | tr '\n' ';')")
  ARGS=()
  for n in "${NOTES[@]}"; do ARGS+=(--note "$n"); done
  python3 benchmarks/serve_h200_report.py --ours "$OUT/ours-a.json" --ours "$OUT/ours-b.json" --peer "$OUT/peer.json" \
    --offline "$OUT/engine-offline.json" --offline-c1 "$OUT/engine-offline-c1.json" --peer-log "$LOGS/peer.log" \
    --out "$OUT/serve-h200.json" "${ARGS[@]}" > "$LOGS/report.log" 2>&1
  echo "report rc=$?"; cat "$OUT/serve-h200.md" 2> /dev/null || tail -20 "$LOGS/report.log"
}

# `attnserve tune` writes its result to a fresh cache folder; a run cut off by the timeout leaves the per-workload
# checkpoint as tune-h200-llama-3-8b.partial.json instead.
step_tune() {
  local name=tune-h200-llama-3-8b t0
  wait_warm
  echo "== attnserve tune --model llama-3-8b ($(left) s left)"
  ATTNSERVE_CACHE_DIR=$(mktemp -d); export ATTNSERVE_CACHE_DIR
  t0=$(date +%s)
  timeout "$(cap "${TUNE_TIMEOUT:-420}")" python3 -m attnserve tune --model llama-3-8b > "$OUT/$name.txt" 2> "$OUT/$name.log"
  echo "tune rc=$? in $(( $(date +%s) - t0 )) s"
  if ls "$ATTNSERVE_CACHE_DIR"/tune-*.json > /dev/null 2>&1; then
    cp "$ATTNSERVE_CACHE_DIR"/tune-*.json "$OUT/$name.json"
  else
    cp "$ATTNSERVE_CACHE_DIR"/tune-*.partial "$OUT/$name.partial.json" 2> /dev/null
    echo "no complete result; the checkpoint is $OUT/$name.partial.json"
  fi
  python3 -m attnserve select --model llama-3-8b --json > "$OUT/$name-select.json" 2>&1
  python3 -m attnserve select --model llama-3-8b > "$OUT/$name-select.txt" 2>&1
  cat "$OUT/$name.txt"; grep -v "race/s" "$OUT/$name.log" | tail -20; cat "$OUT/$name-select.txt"
  unset ATTNSERVE_CACHE_DIR
}

# The step token budget, one step a call: each step's script keeps its own deadline (below the step's cap), writes its
# JSON as it goes and re-merges serve-budget/serve-budget.{json,md} from whatever is under $OUT/serve-budget.
budget_step() {
  local what=$1 want=$2 limit; shift 2
  limit=$(cap "$want")
  echo "== budget-$what ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$limit" python3 benchmarks/serve_h200_budget.py "$what" "$OUT/serve-budget" --deadline-s $(( limit - 25 )) \
    "$@" ${BUDGET_ARGS:-} > "$LOGS/budget-$what.log" 2>&1
  local rc=$?
  echo "budget-$what rc=$rc"; grep -E '^\[' "$LOGS/budget-$what.log" | tail -15
  cat "$OUT/serve-budget/serve-budget.md" 2> /dev/null
  return $rc
}
step_serve_waves() {
  echo "== three waves of 64 streams, one HTTP process and --api-workers 2 ($(left) s left)"
  WAVES_TIMEOUT=$(cap 300) bash benchmarks/serve_h200_waves.sh
}
step_serve_profile() {
  echo "== serve-profile ($(left) s left)"
  OUT=$OUT timeout "$(cap 300)" bash benchmarks/serve_profile.sh > "$LOGS/serve-profile.log" 2>&1
  echo "serve-profile rc=$?"; cat "$LOGS/serve-profile.log" | cut -c1-220 | tail -45
}

step_budget_offline() { budget_step offline 290; }
step_budget_served() { budget_step served 290 ${OFFLINE_JSON:+--offline-json "$OFFLINE_JSON"}; }
step_budget_poisson() { budget_step poisson 290 ${OFFLINE_JSON:+--offline-json "$OFFLINE_JSON"}; }
step_budget_c1() { budget_step c1 200 ${OFFLINE_JSON:+--offline-json "$OFFLINE_JSON"}; }
step_budget_profile() {
  echo "== mixed-step profile ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 200)" python3 benchmarks/engine_gpu_profile.py --modes none --steps 5 \
    --mixed-chunks 2,256,512,1024,2048,4096,8192 --split-mixed on,off --host-profile 256 ${PROFILE_ARGS:-} \
    --out "$OUT/engine_gpu_profile_mixed.json" > "$LOGS/profile-mixed.log" 2>&1
  local rc=$?
  echo "profile rc=$rc"; grep -v -E '^(\{|USDT)' "$LOGS/profile-mixed.log" | tail -60
  echo "== the same mixed steps in piecewise CUDA graphs ($(left) s left)"
  # shellcheck disable=SC2086
  timeout "$(cap 170)" python3 benchmarks/engine_gpu_profile.py --modes none --steps 5 --piecewise \
    --mixed-chunks 2,256,512,1024,2048 --split-mixed on --host-profile 256 ${PROFILE_ARGS:-} \
    --out "$OUT/engine_gpu_profile_mixed_piecewise.json" > "$LOGS/profile-mixed-piecewise.log" 2>&1
  local rc2=$?
  echo "profile piecewise rc=$rc2"; grep -v -E '^(\{|USDT)' "$LOGS/profile-mixed-piecewise.log" | tail -60
  [ $rc -eq 0 ] && return $rc2
  return $rc
}

# tp 1 through the tensor-parallel code path ("triton-graphs-tp1-world": a one-rank NCCL world, the step broadcast,
# all-reduces and the logits all-gather all run) against the plain engine ("triton-graphs"), Llama-3-8B shape,
# 64 x 1024/256, twice in both orders; the summary gives the decode step medians, the world/plain ratio, host syncs
# while launching, and whether both produced the same tokens. About 3 minutes.
step_tp() {
  echo "== tp 1 against the plain engine ($(left) s left)"
  timeout "$(cap 130)" python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256 \
    --configs triton-graphs,triton-graphs-tp1-world --out "$OUT/tp_gpu_run1.json" > "$LOGS/tp_gpu_run1.log" 2>&1
  echo "run 1 rc=$?"
  timeout "$(cap 130)" python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256 \
    --configs triton-graphs-tp1-world,triton-graphs --out "$OUT/tp_gpu_run2.json" > "$LOGS/tp_gpu_run2.log" 2>&1
  echo "run 2 rc=$?"
  python3 - "$OUT" <<'PY'
import json, sys
from datetime import datetime, timezone
out = sys.argv[1]
runs = [json.load(open(f"{out}/tp_gpu_run{i}.json")) for i in (1, 2)]
rows = {}
for run in runs:
    for r in run["results"]:
        rows.setdefault(r["label"], []).append(r)
def med(label, key):
    vals = sorted(r[key] for r in rows.get(label, []) if r.get(key) is not None)
    return vals[len(vals) // 2] if vals else None
plain, world = "triton-graphs", "triton-graphs-tp1-world"
summary = {
    "what": "tp 1 through the tensor-parallel path (one-rank NCCL world) vs the plain engine; " + runs[0]["what"],
    "gpu": runs[0]["gpu"], "versions": runs[0]["versions"], "date": datetime.now(timezone.utc).isoformat(),
    "decode_step_ms_median": {plain: [r["decode_step_ms_median"] for r in rows.get(plain, [])],
                              world: [r["decode_step_ms_median"] for r in rows.get(world, [])]},
    "output_tok_per_s": {plain: [r["output_tok_per_s"] for r in rows.get(plain, [])],
                         world: [r["output_tok_per_s"] for r in rows.get(world, [])]},
    "world_over_plain_decode_step": (round(med(world, "decode_step_ms_median") / med(plain, "decode_step_ms_median"), 3)
                                     if med(plain, "decode_step_ms_median") and med(world, "decode_step_ms_median") else None),
    "same_outputs": len({r["outputs_sha256_16"] for rs in rows.values() for r in rs}) == 1,
    "sync_calls_launching_12_warmup_steps": {k: [r.get("sync_calls_launching_12_warmup_steps") for r in rs]
                                             for k, rs in rows.items()},
    "pages_leaked": sorted({r["pages_leaked"] for rs in rows.values() for r in rs}),
    "errors": [run.get("errors") for run in runs],
}
json.dump(summary, open(f"{out}/tp_gpu_tp1.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
}

RC=0
for s in "${STEPS[@]}"; do
  "step_${s//-/_}" || RC=$?
done
[ -n "$WARM_PID" ] && kill "$WARM_PID" 2> /dev/null
echo "done in $(( $(date +%s) - START )) s"
exit $RC
