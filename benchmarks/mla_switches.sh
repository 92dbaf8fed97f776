#!/usr/bin/env bash
# The Gluon MLA launch's switches on the GPU, in one call: tests/test_gluon_mla.py (each switched build checked
# against the oracle in a child process with a time limit, the shipped kernels' tests beside them), then
# tools/sweep_triton_mla.py's switch race of the switches whose checks passed against the shipped kernels on every
# MLA race workload (those a switch does not touch time the noise).
#
#   OUT=<folder> [MLA_SWITCHES="SCORER_GATHER_KEYS=32 SEESAW_WHOLE_TILES=1"] [ROUNDS=5] [RACE_S=260] \
#     bash benchmarks/mla_switches.sh
#
# -> $OUT/sweep-mla-switches.json, logs under $OUT/logs. Wheels in .whl/ (pytest-xdist) are installed to /tmp/site.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT/logs"
SWITCHES=${MLA_SWITCHES:-SCORER_GATHER_KEYS=32 SEESAW_WHOLE_TILES=1}
# the test each switch's GPU check is
declare -A CHECK=([SCORER_GATHER_KEYS=32]=test_the_32_key_scorer_matches_oracle
                  [SEESAW_WHOLE_TILES=1]=test_the_seesaw_without_the_mask_on_whole_tiles_matches_oracle)
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/logs/pip.log" 2>&1
fi
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
workers=$(python3 -c "import xdist" 2> /dev/null && echo "-n 8")
log=$OUT/logs/pytest-gluon-mla.log
# -rfEp: every failed, errored and passed test named in the summary
# shellcheck disable=SC2086
timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -rfEp $workers tests/test_gluon_mla.py > "$log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)" "$log" | cut -c1-300; tail -1 "$log"
passed() { grep -q "^PASSED .*::$1" "$log" && ! grep -qE "^(FAILED|ERROR) .*::$1" "$log"; }
args=()
for sw in $SWITCHES; do
  if [ -z "${CHECK[$sw]:-}" ]; then echo "$sw: no GPU check named here, not raced"
  elif passed "${CHECK[$sw]}"; then args+=(--gluon-set "$sw")
  else echo "$sw: its GPU check (${CHECK[$sw]}) failed or did not run, not raced"; fi
done
[ ${#args[@]} -gt 0 ] || { echo "nothing to race"; exit 1; }
echo "racing ${args[*]}"
timeout "$(( ${RACE_S:-260} + 60 ))" python3 tools/sweep_triton_mla.py "${args[@]}" --rounds "${ROUNDS:-5}" \
  --budget-s "${RACE_S:-260}" --out "$OUT/sweep-mla-switches.json" > "$OUT/logs/sweep-mla-switches.log" 2>&1
echo "race rc=$?"; grep "median\|budget\|rror" "$OUT/logs/sweep-mla-switches.log" | cut -c1-200
