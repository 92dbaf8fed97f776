#!/usr/bin/env bash
# The wheels of `h200.sh race`'s newest peers (FlashInfer 0.7, FA4 and the CuTe DSL), fetched here and carried to
# the GPU machine in calls of at most 64 MiB each (the tree plus carried folders). The machine keeps /tmp between
# calls only while it stays warm (about 30 s after each call), so the calls below follow one another at once.
#
#   bash benchmarks/peer_wheels.sh fetch   here: the pinned wheels below (cp312, manylinux x86_64, no dependencies)
#                                          -> .peers/wheels/, with each wheel's size and Requires-Dist; says which
#                                          package or version the registry lacks. PEER_EXTRA="name==ver ..." adds more;
#                                          PEER_SET=fa4 fetches only FA4's set (see PEERS)
#   bash benchmarks/peer_wheels.sh pack    here: .peers/wheels/ -> .peers/carry-1/, -2/, ... of at most CARRY_MIB
#                                          (default: what the tree leaves of a call's 64 MiB, less 4) MiB each, wheels over SPLIT_MIB (default 50) MiB split (`split -b`, NAME.part-aa
#                                          ...), each batch with the same MANIFEST (every wheel's sha256 and parts);
#                                          prints the device calls in order
#   bash benchmarks/peer_wheels.sh stage   on the GPU machine, from the repository root, in every call that carries a
#                                          batch: the batch goes to $PEER_STAGE (default /tmp/peer-stage); once every
#                                          part is there the split wheels are joined, every sha256 checked and the set
#                                          installed into $SITE2 (default /tmp/site2, where `h200.sh race` looks).
#                                          Prints what is still missing otherwise; idempotent. Exit 0: $SITE2 holds
#                                          the set; 3: parts still missing; 1: a checksum or the install failed
#
# e.g. bash benchmarks/peer_wheels.sh fetch && bash benchmarks/peer_wheels.sh pack, then the calls it prints:
#      carry [".peers/carry-1"]: bash benchmarks/peer_wheels.sh stage   ... one call per batch ...
#      carry [".whl"]:           OUT=$OUT bash benchmarks/h200.sh race
# .peers/ lies outside .whl/ on purpose: calls carry .whl whole, and the peers would push it past 64 MiB.
# PYTHON (default python3) runs pip; stage needs the machine's Python 3.12 (the wheels are cp312).
# What the GPU machine already has (pip list there, 2026-12-05; Python 3.12.3, torch 2.11.0+cu130): click, cuda-bindings
# 13.3.1, einops 0.8.2, ninja, numpy, nvidia-ml-py, packaging, protobuf, requests, tabulate, typing_extensions; of the
# peers' Requires-Dist it lacks cuda-python, cuda-tile, nccl4py, nccl-extensions and nvidia-cudnn-frontend, which
# FlashInfer 0.7.4 imports only lazily, behind availability checks (cuTile, cuDNN, NCCL EP paths the race never takes).
# FlashInfer 0.7.4's wheel is 96.6 MiB and the CuTe DSL's cu13 libs 87.7 MiB: 191 MiB in all, four carry batches.
set -u

FLASHINFER_VERSION=0.7.4      # the newest 0.7.x; needs neither flashinfer-cubin nor flashinfer-jit-cache to load
FA4_VERSION=4.0.0b36          # flash-attn-4 (flash_attn.cute)
CUTLASS_DSL_VERSION=4.8.1     # nvidia-cutlass-dsl, its libs-base / libs-core and the CUDA 13 libs (libs-cu13)
QUACK_VERSION=0.6.5           # quack-kernels: FA4 imports it
DLPACK_EXT_VERSION=0.1.5      # torch-c-dlpack-ext: tvm-ffi's DLPack hand-over (torch >= 2.10 does it natively)
EINOPS_VERSION=0.8.2
PEERS=(
  "flashinfer-python==$FLASHINFER_VERSION"
  "flash-attn-4==$FA4_VERSION"
  "nvidia-cutlass-dsl==$CUTLASS_DSL_VERSION"
  "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL_VERSION"
  "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL_VERSION"
  "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL_VERSION"
  "quack-kernels==$QUACK_VERSION"
  "torch-c-dlpack-ext==$DLPACK_EXT_VERSION"
  "einops==$EINOPS_VERSION"
)
# PEER_SET=fa4: FA4 and what it imports, for `h200.sh training` (its one peer from these): no FlashInfer 0.7, and
# tvm-ffi here rather than from .whl/, so the training call needs no .whl (about 98 MiB, two batches: the second
# travels in the training call itself)
TVM_FFI_VERSION=0.1.15.post2
case "${PEER_SET:-all}" in
  all) ;;
  fa4) kept=()
       for spec in "${PEERS[@]}"; do [[ $spec == flashinfer-python==* ]] || kept+=("$spec"); done
       PEERS=("${kept[@]}" "apache-tvm-ffi==$TVM_FFI_VERSION") ;;
  *) echo "PEER_SET must be all or fa4, not ${PEER_SET}" >&2; exit 2 ;;
esac
# shellcheck disable=SC2206
[ -n "${PEER_EXTRA:-}" ] && PEERS+=($PEER_EXTRA)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64)

PEER_DIR=.peers
WHEELS=$PEER_DIR/wheels
SPLIT_MIB=${SPLIT_MIB:-50}  # wheels over it are split into parts of this size
CALL_MIB=64
CALL_MARGIN_MIB=4  # a call of 63.6 MiB by this count (54.3 carried + 9.3 tree) was refused as over 64: keep clear of it
PYTHON=${PYTHON:-python3}
MIB=1048576

mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
size() { stat -c %s "$1"; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

ensure_ignored() {
  # the peers must never travel with the tree: 190 MiB of untracked files would go with every call
  if ! git check-ignore -q "$PEER_DIR/carry-1/x" 2> /dev/null; then
    grep -qx "/$PEER_DIR/" .git/info/exclude 2> /dev/null || echo "/$PEER_DIR/" >> .git/info/exclude
  fi
  git check-ignore -q "$PEER_DIR/carry-1/x" || { echo "$PEER_DIR/ is not git-ignored: it would travel with every call" >&2; exit 1; }
}

cmd_fetch() {
  local spec out rc saved=() missing=() f w keep
  ensure_ignored
  mkdir -p "$WHEELS"
  for spec in "${PEERS[@]}"; do
    out=$("$PYTHON" -m pip download --no-deps "${PLATFORM[@]}" -d "$WHEELS" "$spec" 2>&1); rc=$?
    f=$(printf '%s\n' "$out" | sed -nE 's/^[[:space:]]*(Saved|File was already downloaded) (.*)$/\2/p' | tail -1)
    if [ "$rc" -ne 0 ] || [ -z "$f" ]; then
      missing+=("$spec")
      echo "NOT FETCHED: $spec (the registry has no cp312 / manylinux x86_64 / pure-python wheel of it, or was unreachable)"
      printf '%s\n' "$out" | grep -E '^ERROR' | head -3 | sed 's/^/    /'
      f=$("$PYTHON" -m pip index versions --pre "${spec%%[=<>!~]*}" 2> /dev/null | sed -n 's/^Available versions: //p')
      echo "    versions there: ${f:-none}" | cut -c1-200
      continue
    fi
    saved+=("$(basename "$f")")
  done
  # what an earlier fetch left with other versions would be carried too: remove it (once the whole set is here)
  for w in "$WHEELS"/*.whl; do
    if [ ! -e "$w" ] || [ ${#missing[@]} -gt 0 ]; then continue; fi
    keep=0
    for f in "${saved[@]}"; do [ "$f" = "$(basename "$w")" ] && keep=1; done
    [ "$keep" = 1 ] || { echo "removed (not in the pinned set): $w"; rm -f "$w"; }
  done
  echo
  echo "== $WHEELS"
  local total=0
  for f in "${saved[@]}"; do
    w=$WHEELS/$f
    total=$((total + $(size "$w")))
    printf '%-82s %8s MiB\n' "$f" "$(mib "$(size "$w")")"
    unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | tr -d '\r' | sed 's/^/    /'
  done
  echo "total $(mib "$total") MiB in ${#saved[@]} wheels"
  if [ ${#missing[@]} -gt 0 ]; then
    echo "MISSING from the registry: ${missing[*]}"
    return 1
  fi
}

cmd_pack() {
  local w n s b i items=() carry_bytes=() parts_of=() tree_bytes
  ls "$WHEELS"/*.whl > /dev/null 2>&1 || { echo "no wheels in $WHEELS: run fetch first" >&2; return 1; }
  ensure_ignored
  rm -rf "$PEER_DIR"/carry-* "$PEER_DIR/split"
  mkdir -p "$PEER_DIR/split"
  # items: "bytes path" for every whole small wheel and every part of a big one
  for w in "$WHEELS"/*.whl; do
    n=$(basename "$w"); s=$(size "$w")
    if [ "$s" -gt $((SPLIT_MIB * MIB)) ]; then
      split -b "${SPLIT_MIB}M" "$w" "$PEER_DIR/split/$n.part-"
      for i in "$PEER_DIR/split/$n".part-*; do items+=("$(size "$i") $i"); done
    else
      items+=("$s $w")
    fi
  done
  # first fit, biggest first, into batches of at most CARRY_MIB
  tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2> /dev/null | tail -1 | cut -f1)
  local carry_mib=${CARRY_MIB:-$(( CALL_MIB - CALL_MARGIN_MIB - (tree_bytes + MIB - 1) / MIB ))}
  local cap=$((carry_mib * MIB)) placed
  while read -r s i; do
    placed=0
    for b in "${!carry_bytes[@]}"; do
      if [ $((carry_bytes[b] + s)) -le "$cap" ]; then placed=1; break; fi
    done
    if [ "$placed" = 0 ]; then b=${#carry_bytes[@]}; carry_bytes[b]=0; fi
    carry_bytes[b]=$((carry_bytes[b] + s))
    mkdir -p "$PEER_DIR/carry-$((b + 1))"
    if [ "$(dirname "$i")" = "$PEER_DIR/split" ]; then
      mv "$i" "$PEER_DIR/carry-$((b + 1))/"
    else
      ln -f "$i" "$PEER_DIR/carry-$((b + 1))/" 2> /dev/null || cp -f "$i" "$PEER_DIR/carry-$((b + 1))/"
    fi
    parts_of+=("$(basename "$i") $((b + 1))")
  done < <(printf '%s\n' "${items[@]}" | sort -rn)
  rmdir "$PEER_DIR/split"
  # one MANIFEST, the same in every batch: "wheel NAME SHA256 BYTES BATCH:FILE ..." (parts in join order)
  local manifest=$PEER_DIR/MANIFEST.tmp line p set
  : > "$manifest"
  for w in "$WHEELS"/*.whl; do
    n=$(basename "$w"); line="wheel $n $(sha "$w") $(size "$w")"
    for p in $(printf '%s\n' "${parts_of[@]}" | awk -v n="$n" '$1 == n || index($1, n ".part-") == 1 {print $1 ":" $2}' | sort); do
      line="$line ${p##*:}:${p%:*}"
    done
    echo "$line" >> "$manifest"
  done
  set=$(sha256sum "$manifest" | cut -c1-16)
  for b in "${!carry_bytes[@]}"; do
    { echo "# peer wheels for /tmp/site2, written by benchmarks/peer_wheels.sh pack; every batch has the same one"
      echo "set $set"
      echo "batches ${#carry_bytes[@]}"
      cat "$manifest"; } > "$PEER_DIR/carry-$((b + 1))/MANIFEST"
  done
  rm -f "$manifest"
  echo "== ${#carry_bytes[@]} batches (set $set); the tree travels too: $(mib "$tree_bytes") MiB"
  for b in "${!carry_bytes[@]}"; do
    s=$(du -cb "$PEER_DIR/carry-$((b + 1))" | tail -1 | cut -f1)
    printf '%s  %6s MiB:' "$PEER_DIR/carry-$((b + 1))" "$(mib "$s")"
    for i in "$PEER_DIR/carry-$((b + 1))"/*; do [ "${i##*/}" = MANIFEST ] || printf ' %s' "${i##*/}"; done
    echo
    [ $((s + tree_bytes)) -le $(((CALL_MIB - CALL_MARGIN_MIB) * MIB)) ] \
      || echo "    WARNING: with the tree this call carries $(mib $((s + tree_bytes))) MiB, over $((CALL_MIB - CALL_MARGIN_MIB)) (lower CARRY_MIB)"
  done
  local whl_bytes
  whl_bytes=$(du -cb .whl/*.whl 2> /dev/null | tail -1 | cut -f1)
  echo
  echo "== device calls, in this order, each started as soon as the one before returns (the machine keeps /tmp"
  echo "   only about 30 s after a call; a cold machine starts bare and the staging starts over from batch 1):"
  for b in "${!carry_bytes[@]}"; do
    echo "  $((b + 1)). carry [\"$PEER_DIR/carry-$((b + 1))\"]   command: bash benchmarks/peer_wheels.sh stage"
  done
  if [ "${PEER_SET:-all}" = fa4 ]; then
    echo "     (the training call itself may carry the last batch: command: bash benchmarks/peer_wheels.sh stage &&"
    echo "      OUT=\$OUT bash benchmarks/h200.sh training; it needs no .whl)"
  else
    echo "  $(( ${#carry_bytes[@]} + 1 )). carry [\".whl\"] ($(mib "${whl_bytes:-0}") MiB)   command: OUT=\$OUT bash benchmarks/h200.sh race"
    echo "     (install_peers uses the /tmp/site2 that stage installed; stage's exit 3 means a batch is still missing)"
  fi
}

cmd_stage() {
  local stage=${PEER_STAGE:-/tmp/peer-stage} site2=${SITE2:-/tmp/site2} m set have carried=0
  for m in "$PEER_DIR"/carry-*/MANIFEST; do
    [ -f "$m" ] || continue
    carried=1
    set=$(awk '$1 == "set" {print $2}' "$m")
    if [ -f "$site2/.peer-set" ] && [ "$(cat "$site2/.peer-set")" = "$set" ]; then
      echo "$(dirname "$m"): $site2 already holds set $set"; continue
    fi
    if [ -f "$stage/MANIFEST" ]; then
      have=$(awk '$1 == "set" {print $2}' "$stage/MANIFEST")
      [ "$have" = "$set" ] || { echo "$stage held set $have, not $set: starting over"; rm -rf "$stage"; }
    fi
    mkdir -p "$stage"
    cp -f "$m" "$stage/MANIFEST"
    find "$(dirname "$m")" -maxdepth 1 -type f ! -name MANIFEST -exec cp -f {} "$stage/" \;
    echo "staged $(dirname "$m") -> $stage"
  done
  [ "$carried" = 1 ] || echo "no $PEER_DIR/carry-N carried in this call"
  if [ ! -f "$stage/MANIFEST" ]; then
    if [ -f "$site2/.peer-set" ]; then echo "$site2 holds set $(cat "$site2/.peer-set")"; return 0; fi
    echo "nothing staged in $stage and no $site2 (a fresh machine?): carry $PEER_DIR/carry-1 first"; return 3
  fi
  set=$(awk '$1 == "set" {print $2}' "$stage/MANIFEST")
  if [ -f "$site2/.peer-set" ] && [ "$(cat "$site2/.peer-set")" = "$set" ]; then
    echo "$site2 holds set $set"; stage_check "$site2"; return 0
  fi
  # join what is complete, check every wheel's sha256, list what is not there yet
  local kind name want bytes parts f missing=() wheels=() bad=0 ok
  while read -r kind name want bytes parts; do
    [ "$kind" = wheel ] || continue
    if [ -f "$stage/$name" ] && [ "$(sha "$stage/$name")" = "$want" ]; then
      wheels+=("$stage/$name")
      for f in $parts; do [ "${f#*:}" = "$name" ] || rm -f "$stage/${f#*:}"; done  # a batch carried again
      continue
    fi
    ok=1
    for f in $parts; do [ -f "$stage/${f#*:}" ] || { ok=0; missing+=("${f#*:} (batch ${f%%:*})"); }; done
    [ "$ok" = 1 ] || continue
    if [ "${parts#*:}" != "$name" ]; then  # split: join the parts in order
      # shellcheck disable=SC2046
      cat $(for f in $parts; do echo "$stage/${f#*:}"; done) > "$stage/$name.tmp" && mv "$stage/$name.tmp" "$stage/$name"
    fi
    if [ "$(sha "$stage/$name")" = "$want" ]; then
      wheels+=("$stage/$name")
      for f in $parts; do [ "${f#*:}" = "$name" ] || rm -f "$stage/${f#*:}"; done
    else
      echo "sha256 mismatch: $name ($(size "$stage/$name") bytes, want $bytes); carry again:" \
        "$(for f in $parts; do printf '%s ' "$PEER_DIR/carry-${f%%:*}"; done)"
      rm -f "$stage/$name"; for f in $parts; do rm -f "$stage/${f#*:}"; done
      bad=1
    fi
  done < "$stage/MANIFEST"
  [ "$bad" = 0 ] || return 1
  if [ ${#missing[@]} -gt 0 ]; then
    echo "still missing for set $set (${#wheels[@]} wheels complete):"
    printf '  %s\n' "${missing[@]}"
    echo "carry next: $(printf '%s\n' "${missing[@]}" | sed -E 's/.*\(batch ([0-9]+)\)/\1/' | sort -un \
      | sed "s|^|$PEER_DIR/carry-|" | tr '\n' ' ')"
    return 3
  fi
  # the whole set at once, into a fresh folder moved into place only when complete
  rm -rf "$site2.tmp"
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site2.tmp" "${wheels[@]}" \
    > "$stage/pip.log" 2>&1; then
    echo "pip install into $site2 failed:"; tail -5 "$stage/pip.log"; rm -rf "$site2.tmp"; return 1
  fi
  echo "$set" > "$site2.tmp/.peer-set"
  [ -e "$site2" ] && echo "replacing the $site2 that was there"
  rm -rf "$site2" && mv "$site2.tmp" "$site2"
  echo "installed ${#wheels[@]} wheels (set $set) into $site2"
  stage_check "$site2"
}

# Which load-time imports of FlashInfer 0.7 and FA4 this machine's python finds with $site2 on the path
# (find_spec only: no GPU needed). tvm_ffi comes from .whl/ (/tmp/site) in the race call.
stage_check() {
  local site2=$1
  PYTHONPATH="$site2:$site2/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - << 'PY'
import importlib.util
needs = {  # module: (wheel, who imports it at load)
    "flashinfer": ("flashinfer-python", "the race's child"), "flash_attn.cute": ("flash-attn-4", "fa4"),
    "cutlass": ("nvidia-cutlass-dsl-libs-base", "fa4, quack"), "quack": ("quack-kernels", "fa4"),
    "einops": ("einops", "fa4"), "torch_c_dlpack_ext": ("torch-c-dlpack-ext", "tvm-ffi, optional"),
    "torch": ("torch", "all"), "numpy": ("numpy", "flashinfer, cutlass"),
    "typing_extensions": ("typing-extensions", "cutlass"), "cuda.bindings": ("cuda-bindings", "cutlass, fa4"),
    "pynvml": ("nvidia-ml-py", "flashinfer"), "requests": ("requests", "flashinfer 0.7 (artifacts.py)"),
    "jinja2": ("jinja2", "flashinfer"), "filelock": ("filelock", "flashinfer"), "tqdm": ("tqdm", "flashinfer"),
    "packaging": ("packaging", "flashinfer, torch-c-dlpack-ext"), "tvm_ffi": ("apache-tvm-ffi", "from .whl/"),
}
absent = []
for mod, (wheel, who) in needs.items():
    try:
        found = importlib.util.find_spec(mod) is not None
    except Exception:
        found = False
    if not found:
        absent.append(f"{mod} ({wheel}; {who})")
print("load-time imports absent here:", "; ".join(absent) if absent else "none")
PY
}

case "${1:-}" in
  fetch) cmd_fetch ;;
  pack) cmd_pack ;;
  stage) cmd_stage ;;
  *) sed -n '2,24p' "$0"; exit 2 ;;
esac
