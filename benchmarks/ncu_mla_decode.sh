#!/usr/bin/env bash
# Nsight Compute on a Gluon MLA decode kernel, on the H200 (Firecracker machines read the counters; the clocks are
# left alone): 1 x 32768 at 64 splits and 128 x 4096 at one split, 128 heads, page 1. Writes under $OUT each
# workload's details page and its per-instruction SASS table (warp stall samples by reason), as CSV.
#   OUT=<folder> KERNEL=gluon_colsplit bash benchmarks/ncu_mla_decode.sh
set -u
OUT=${OUT:-/tmp/ncu}; KERNEL=${KERNEL:-gluon_colsplit}; mkdir -p "$OUT"
export PYTHONPATH=src:benchmarks PYTHONUNBUFFERED=1
for w in "1 32768 64" "128 4096 1"; do
  tag=$KERNEL-$(echo $w | tr ' ' _)
  timeout 150 ncu --clock-control none -k regex:mla_decode --launch-skip 3 --launch-count 1 --set full \
    --import-source yes -o "/tmp/$tag" python3 benchmarks/mla_decode_once.py $w "$KERNEL" > "/tmp/$tag.log" 2>&1
  echo "ncu $tag rc=$?"
  ncu --import "/tmp/$tag.ncu-rep" --page details --print-units base > "$OUT/details-$tag.txt" 2>&1
  ncu --import "/tmp/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/sass-$tag.csv" 2>&1
  grep -E "Duration|Shared is" "$OUT/details-$tag.txt"
done
