#!/usr/bin/env bash
# One NVIDIA GPU, from a fresh clone, in under 8 minutes: install the `cuda` extra into a venv
# of its own (the CPU .venv is left alone), check that JAX sees the GPU, then print `make bench`
# figures (tok/s, ms/step, MFU against common/train.py's PEAK_TFLOPS, compile time) for
#   (a) train_dense.py llama3.2-1b: bfloat16, seq 4096, BATCH rows, remat, --model.attention ATTN
#       (auto: cuDNN's fused attention on a GPU)
#   (b) train_moe.py tiny-moe, and its dense twin
# with the device name and JAX version first and one summary line per run at the end.
#
#   usage: bash bench/gpu.sh                      (or `make bench-gpu`; from any directory)
#          BATCH=4 ATTN=cudnn bash bench/gpu.sh   (the environment below changes it)
#          DRY_RUN=1 bash bench/gpu.sh            (print the two bench commands; needs no GPU)
#
# Environment, all optional:
#   PYTHON      the interpreter that builds a new venv (default python3; 3.11 or newer)
#   VENV        the venv (default .venv-gpu; a relative path is taken from the repository root)
#   EXTRAS      pip extras of this project to install (default cuda). A venv that already holds
#               the packages of the project's dependencies and EXTRAS is reused without pip, so
#               `VENV=.venv EXTRAS=test bash bench/gpu.sh` skips the large CUDA wheels
#   INSTALL     auto (default: pip only when a package is missing), 1 (pip always), 0 (never)
#   BATCH       per-GPU batch of (a) (default 8). `--dry-run` on the CPU puts it at ~40 GiB with
#               full remat when attention keeps no [T, T] scores (seq 512, batch 64), inside the
#               75% of an 80 GB GPU that JAX takes; the scores of ATTN=xla or einsum at seq 4096
#               bring it to ~100 GiB, so BATCH=2 there (61 GiB at 4)
#   SEQ         sequence length of (a) (default 4096)
#   ATTN        --model.attention of (a): auto (default: train_dense.py's choice for the device,
#               cuDNN's fused kernel on a GPU), cudnn, xla or einsum
#   REMAT       --model.remat of (a): full (default), dots or none
#   STEPS       timed steps of each run (default 10), after compilation and a warm-up step
#   CHECK_STEPS steps of tiny and tiny-moe trained on the GPU and on the CPU, their losses
#               compared by bench/gpu_check.py after its kernel checks (default 30; 0: kernels only)
#   PEAK_TFLOPS per-GPU peak for MFU (--train.peak-tflops) where common/train.py's table lacks
#               the chip; unset: the table
#   DENSE_ARGS, MOE_ARGS  more flags for (a) and (b), split on spaces
#   CUDA_VISIBLE_DEVICES  the GPU to run on (default 0: per-GPU figures on a bigger node)
#   LOG_DIR     where each run's whole output goes (default runs/bench-gpu)
#   NVIDIA_SMI  the nvidia-smi to ask (default: the one on PATH)
#   DRY_RUN     1: print the bench commands and exit before anything is installed or checked
#
# Exit status: 0 when both runs printed their figures; 1 when a run failed (the other still
# runs); 2 for a bad setting; 3 when there is no NVIDIA GPU (before any benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
EXTRAS=${EXTRAS:-cuda}
INSTALL=${INSTALL:-auto}
BATCH=${BATCH:-8}
SEQ=${SEQ:-4096}
ATTN=${ATTN:-auto}
REMAT=${REMAT:-full}
STEPS=${STEPS:-10}
CHECK_STEPS=${CHECK_STEPS:-30}
PEAK_TFLOPS=${PEAK_TFLOPS:-}
DENSE_ARGS=${DENSE_ARGS:-}
MOE_ARGS=${MOE_ARGS:-}
LOG_DIR=${LOG_DIR:-runs/bench-gpu}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
DRY_RUN=${DRY_RUN:-0}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-0}
PY=$VENV/bin/python

say() { echo "gpu.sh: $*"; }
die() { local code=$1; shift; echo "gpu.sh: $*" >&2; exit "$code"; }

case $INSTALL in auto|0|1) ;; *) die 2 "INSTALL=$INSTALL: use auto, 0 or 1" ;; esac
[[ $CHECK_STEPS =~ ^[0-9]+$ ]] || die 2 "CHECK_STEPS=$CHECK_STEPS: a whole number, please"
for v in BATCH SEQ STEPS; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die 2 "$v=${!v}: a positive whole number, please"
done
[[ -z $PEAK_TFLOPS || $PEAK_TFLOPS =~ ^[0-9]+([.][0-9]*)?$ ]] ||
  die 2 "PEAK_TFLOPS=$PEAK_TFLOPS: a number of TFLOP/s, please"

PEAK=()  # expanded as ${PEAK[@]+...}: bash before 4.4 calls an empty array unbound under set -u
[ -n "$PEAK_TFLOPS" ] && PEAK=(--train.peak-tflops "$PEAK_TFLOPS")
# shellcheck disable=SC2206  # DENSE_ARGS and MOE_ARGS are flag lists, split on purpose
DENSE=(train_dense.py llama3.2-1b --bench "$STEPS" --model.dtype bfloat16 --train.seq-len "$SEQ"
       --train.batch-size "$BATCH" --model.remat "$REMAT" --model.attention "$ATTN"
       ${PEAK[@]+"${PEAK[@]}"} $DENSE_ARGS)
# shellcheck disable=SC2206
MOE=(train_moe.py tiny-moe --bench "$STEPS" ${PEAK[@]+"${PEAK[@]}"} $MOE_ARGS)

if [ "$DRY_RUN" = 1 ]; then
  echo "$PY ${DENSE[*]}"
  echo "$PY ${MOE[*]}"
  exit 0
fi

# --- 1. A driver and a GPU, before anything is downloaded ------------------------------------
command -v "$NVIDIA_SMI" >/dev/null 2>&1 ||
  die 3 "no NVIDIA GPU: '$NVIDIA_SMI' not found (no NVIDIA driver on this machine); this script needs one"
GPUS=$("$NVIDIA_SMI" -L 2>&1) || true
grep -q '^GPU ' <<<"$GPUS" ||
  die 3 "no NVIDIA GPU: '$NVIDIA_SMI -L' lists none: ${GPUS:-nothing}; this script needs one"
say "nvidia-smi sees $(grep -c '^GPU ' <<<"$GPUS") GPU(s); CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
"$NVIDIA_SMI" --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
  sed 's/^/  /' || true

# --- 2. The venv: reused when it already holds every package, else pip -----------------------
# Names only (pip checks versions when it installs): the project's dependencies and EXTRAS from
# pyproject.toml, and the extras those ask of their own packages (jax[cuda12] -> the plugin).
missing() {
  "$PY" - "$EXTRAS" <<'EOF'
import re, sys, tomllib
from importlib import metadata

norm = lambda s: re.sub(r"[-_.]+", "-", s.strip().lower())
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
optional = {norm(k): v for k, v in project.get("optional-dependencies", {}).items()}
extras = {norm(e) for e in sys.argv[1].split(",") if e.strip()}
if extras - set(optional):
    sys.exit(f"EXTRAS: no extra {sorted(extras - set(optional))} in pyproject.toml "
             f"(it has {sorted(optional)})")
seen, absent = set(), []

def need(req: str) -> None:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req.split(";")[0])
    name, asked = m.group(1), {norm(e) for e in (m.group(2) or "").split(",") if e.strip()}
    if (norm(name), frozenset(asked)) in seen:
        return
    seen.add((norm(name), frozenset(asked)))
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        absent.append(name)
        return
    for r in dist.requires or []:
        wanted = re.findall(r"extra\s*==\s*[\"']([^\"']+)[\"']", r.partition(";")[2])
        if any(norm(w) in asked for w in wanted):
            need(r)

for req in project["dependencies"] + [r for e in sorted(extras) for r in optional[e]]:
    need(req)
print(" ".join(absent))
EOF
}

if [ "$INSTALL" = 0 ]; then
  [ -x "$PY" ] || die 2 "INSTALL=0 but there is no $PY"
  say "INSTALL=0: using $VENV as it is"
else
  todo=all
  if [ "$INSTALL" = auto ] && [ -x "$PY" ]; then
    todo=$(missing) || die 2 "could not read what $VENV holds (above)"
  fi
  if [ -z "$todo" ]; then
    say "reusing $VENV: it holds every package of .[$EXTRAS]; no pip"
  else
    if [ ! -x "$PY" ]; then
      "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
        die 2 "PYTHON=$PYTHON: this project needs Python 3.11 or newer"
      say "creating $VENV with $PYTHON"
      "$PYTHON" -m venv "$VENV"
      "$PY" -m pip install -q --upgrade pip
    fi
    say "installing .[$EXTRAS] into $VENV (missing: $todo; the CUDA wheels are a few GB)"
    "$PY" -m pip install -q -e ".[$EXTRAS]"
  fi
fi

# --- 3. JAX on the GPU: the device and the versions, first -----------------------------------
"$PY" - <<'EOF'
import os, sys
from importlib import metadata

try:
    import jax
    devices = jax.devices()
except Exception as e:  # a broken CUDA install can raise rather than fall back to the CPU
    print(f"gpu.sh: no NVIDIA GPU visible to JAX: jax.devices() raised {e!r}; this script "
          "needs one", file=sys.stderr)
    sys.exit(3)
gpus = [d for d in devices if d.platform == "gpu"]
if not gpus:
    hint = (f" (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} hides it)"
            if os.environ.get("JAX_PLATFORMS") else " (is the cuda extra installed? EXTRAS=cuda)")
    print(f"gpu.sh: no NVIDIA GPU visible to JAX: jax.devices() = {devices}; this script needs "
          f"one{hint}", file=sys.stderr)
    sys.exit(3)
from common.train import peak_flops_per_device  # the table the MFU figures divide by


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


peak, source = peak_flops_per_device(float(os.environ.get("PEAK_TFLOPS") or 0))
print(f"gpu.sh: device {gpus[0].device_kind} ({len(gpus)} visible to JAX) | jax {jax.__version__}, "
      f"jaxlib {version('jaxlib')}, " + ", ".join(
          f"{p} {version(p)}" for p in ("jax-cuda12-plugin", "jax-cuda13-plugin")
          if version(p) != "absent"))
print(f"gpu.sh: peak {peak / 1e12:.4g} TFLOP/s per device ({source})"
      + ("" if peak else ": MFU will read 'unknown'; set PEAK_TFLOPS"))
EOF

# --- 4. The kernels against the reference, the trainers' losses against the CPU's ------------
mkdir -p "$LOG_DIR"
SUMMARY=() FAILED=0
echo
say "== checks: bench/gpu_check.py $CHECK_STEPS"
set +e
"$PY" bench/gpu_check.py "$CHECK_STEPS" 2>&1 | tee "$LOG_DIR/check.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 0 ]; then SUMMARY+=("checks | ok: $(grep -c '^gpu_check: ok' "$LOG_DIR/check.log") passed")
else FAILED=1; SUMMARY+=("checks | FAILED (exit $rc): see $LOG_DIR/check.log"); fi

# --- 5. The benchmarks: each one's whole output kept, a failure does not stop the next -------
# What common/train.py's bench prints, e.g.
#   bench moe | 1488 tok/s | 2752.0 ms/step (median of 10, min ...) | MFU 27.2% of 989 TFLOP/s
#     per device (NVIDIA H100 80GB HBM3 data sheet) | compile 8.7 s
#   bench | the MoE step costs 1.30x the dense step per active FLOP
# made into one line: "| moe 1488 tok/s, 2752.0 ms/step, MFU 27.2% of 989 TFLOP/s, compile 8.7 s".
figures() {
  sed -nE -e 's/^bench ?([a-z]*) \| ([0-9.]+ tok\/s) \| ([0-9.]+ ms\/step)[^|]*\| (MFU [^ ]+)( of [0-9.e+]+ TFLOP\/s)?[^|]*\| (compile [0-9.]+ s).*/| \1 \2, \3, \4\5, \6/p' \
          -e 's/^bench \| the MoE step costs ([0-9.]+x) .*/| MoE step costs \1 the dense per active FLOP/p' "$1" |
    tr '\n' ' ' | sed -E 's/\|  /| /g; s/ +$//; s/\| dense /| dense twin /'
}
bench() {  # label, log file, command...
  local label=$1 log=$2 t=$SECONDS rc found why
  shift 2
  echo
  say "== $label: $PY $*"
  set +e
  "$PY" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  found=$(figures "$log")
  if [ "$rc" != 0 ] || [ -z "$found" ]; then
    FAILED=1
    why="exit $rc"
    if grep -q RESOURCE_EXHAUSTED "$log"; then why+=", out of GPU memory: try a smaller BATCH, or ATTN=cudnn"; fi
    SUMMARY+=("$label | FAILED ($why, $((SECONDS - t)) s): see $log")
  else
    SUMMARY+=("$label $found | $((SECONDS - t)) s")
  fi
}
bench "llama3.2-1b bf16 seq $SEQ batch $BATCH attention $ATTN remat $REMAT" "$LOG_DIR/dense.log" \
  "${DENSE[@]}"
bench "tiny-moe" "$LOG_DIR/moe.log" "${MOE[@]}"

echo
say "summary ($((SECONDS - T0)) s in all; logs in $LOG_DIR/)"
for s in "${SUMMARY[@]}"; do echo "RESULT $s"; done
exit "$FAILED"
