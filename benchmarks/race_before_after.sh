#!/usr/bin/env bash
# The kernel race before and after a change, in one device call: h200.sh mha mla on an older tree, then on this
# one, then `bench compare` per race (what moves between leases cancels within one call).
#
# Here, first:   rm -rf .before && mkdir .before && git archive REV src benchmarks pyproject.toml | tar -x -C .before
#                grep -qx '/.before/' .git/info/exclude || echo '/.before/' >> .git/info/exclude
# On the GPU (carry [".whl", ".before"]):   OUT=$OUT bash benchmarks/race_before_after.sh
# -> $OUT/race.tgz: race/{before,after}/kernels{,-mla}-h200.json, their logs, race/compare.log
set -u
ROOT=$PWD
R=${OUT:-out}/race
[ -d .before/src ] || { echo "no .before/ tree: see the top of $0" >&2; exit 2; }
mkdir -p "$R"
ln -sfn "$ROOT/.whl" .before/.whl
(cd .before && BUDGET=${HALF_S:-285} OUT=$R/before PYTHONPATH=$ROOT/.before/src bash "$ROOT/.before/benchmarks/h200.sh" mha mla) \
  > "$R/before.log" 2>&1
echo "before rc=$?"; tail -5 "$R/before.log"
BUDGET=${HALF_S:-285} OUT=$R/after PYTHONPATH=$ROOT/src bash benchmarks/h200.sh mha mla > "$R/after.log" 2>&1
echo "after rc=$?"; tail -5 "$R/after.log"
for k in kernels-h200 kernels-mla-h200; do
  OUT=$R bash benchmarks/h200.sh compare "$R/before/$k.json" "$R/after/$k.json" 2>&1 | tee -a "$R/compare.log"
done
tar czf "${OUT:-out}/race.tgz" -C "${OUT:-out}" race
