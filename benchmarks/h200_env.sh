# Sourced by the H200 scripts: the project and the carried wheels on PYTHONPATH, the GPU and versions
# recorded under $LOGS, and a time budget: `left` says the seconds left of $BUDGET, `cap N` is min(N, left).
# Expects OUT, LOGS and BUDGET to be set by the script that sources it.
mkdir -p "$OUT" "$LOGS"
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 5 ? l : 5 )) || echo "$1"; }
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=16
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$LOGS/smi.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$LOGS/pip.log" 2>&1 \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tee "$LOGS/versions.txt"
