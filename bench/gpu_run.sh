#!/usr/bin/env bash
# The GPU run in one device call (bench/README.md, "The GPU run: one call"):
#
#   FASTCOV_COMMIT=<sha> bash bench/gpu_run.sh                 # on the lent GPU; rows under $OUT
#   bash bench/gpu_run.sh --rehearse --out DIR                 # the same on CPU at toy sizes (tests/benchmarks/test_gpu_run.py)
#
# 1. checks the carried wheels (.whl/, from ../shared/gpu/prepare.sh) and installs them with fastcov;
# 2. prints GPU, driver, CUDA, torch, triton, setuptools, numpy and pyarrow versions;
# 3. runs bench.gpu_suite's parts in order, each under its own cap, all under --budget seconds (counted from
#    this script's start): correctness, kernels, train, pytest, extra (only if its whole cap is left).
#    Rows are appended and fsynced as each measurement finishes; a part not reached says so.
# Under OUT (at most 8 files): run.log, run.jsonl, run.md, kernels.jsonl, kernels.md.
#
# Options: --rehearse, --budget SECONDS (default 450; rehearsal 170), --out DIR (default $OUT, else runs/gpu-run),
# --wheels DIR (default .whl), --parts A,B,... (default all), --python PY (default python3); anything else goes
# to bench.gpu_suite (--cap PART=S, --steps N, and in the rehearsal --fault PART=crash|hang).
set -uo pipefail
START=$(date +%s)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
REHEARSE=0 BUDGET="" OUTDIR="${OUT:-}" WHEELS=.whl PARTS=all PY="${PYTHON:-python3}" SITE="${GPU_RUN_SITE:-/tmp/site}"
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rehearse) REHEARSE=1 ;;
    --budget) BUDGET="$2"; shift ;;
    --out) OUTDIR="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    --parts) PARTS="$2"; shift ;;
    --python) PY="$2"; shift ;;
    *) PASS+=("$1") ;;
  esac
  shift
done
[ -n "$BUDGET" ] || BUDGET=$([ $REHEARSE = 1 ] && echo 170 || echo 450)
OUTDIR="${OUTDIR:-runs/gpu-run}"
mkdir -p "$OUTDIR" || { echo "gpu_run: cannot create the output folder $OUTDIR"; exit 2; }
OUTDIR=$(cd "$OUTDIR" && pwd)
exec > >(tee -a "$OUTDIR/run.log") 2>&1
TEE=$!
SETUP=$(mktemp "${TMPDIR:-/tmp}/gpu-run-setup.XXXXXX")
FAILED=0

# one setup row: status, name, message (bench.gpu_suite --setup records them); one line on the console
step() {
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$SETUP"
  echo "gpu_run: $2: $1${3:+: $3}"
  [ "$1" = ok ] || FAILED=1
}

echo "gpu_run: $([ $REHEARSE = 1 ] && echo 'rehearsal on CPU' || echo 'GPU run'), budget ${BUDGET} s, out $OUTDIR"

# --- the carried wheels: every one the GPU side needs (../shared/gpu/README.md), by distribution name
REQUIRED_WHEELS="liger_kernel cut_cross_entropy deepspeed pydantic pydantic_core annotated_types typing_inspection
hjson math_verify latex2sympy2_extended antlr4_python3_runtime verl"
missing=""
for w in $REQUIRED_WHEELS; do
  ls "$WHEELS/$w"-[0-9]*.whl >/dev/null 2>&1 || missing="$missing $w"
done
if [ -n "$missing" ]; then
  step error "wheels" "missing from $WHEELS/:$missing (bash ../shared/gpu/prepare.sh copies them to .whl/; name .whl in carry)"
else
  bad=$("$PY" -c 'import sys, zipfile; print(" ".join(f for f in sys.argv[1:] if not zipfile.is_zipfile(f)))' \
        "$WHEELS"/*.whl)
  if [ -n "$bad" ]; then step error "wheels" "not a wheel (zip): $bad"
  else step ok "wheels" "$(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS/ ($(du -sh "$WHEELS" | cut -f1))"; fi
fi

# --- install: the wheels into /tmp/site, fastcov editable (its package-dir mapping needs an install)
if [ $REHEARSE = 1 ]; then
  step ok "install" "skipped in the rehearsal (this environment's own install)"
else
  if [ -z "$missing" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    if log=$("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
             "$WHEELS"/*.whl 2>&1); then
      step ok "install wheels" "into $SITE"
    else
      step error "install wheels" "pip failed: $(echo "$log" | tail -n 1)"
    fi
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if log=$("$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1); then
    step ok "install fastcov" "pip install -e ."
  else
    # without setuptools/wheel: link the mapped packages into fastcov/ of this (travelled) copy of the tree
    for pkg in kernels trainer configs; do [ -e "fastcov/$pkg" ] || ln -s "../$pkg" "fastcov/$pkg"; done
    step ok "install fastcov" "pip install -e . failed ($(echo "$log" | tail -n 1)); linked kernels, trainer, configs into fastcov/"
  fi
fi
if log=$("$PY" -c 'import fastcov.kernels, fastcov.trainer' 2>&1); then
  step ok "import fastcov" "fastcov.kernels and fastcov.trainer import"
else
  step error "import fastcov" "$(echo "$log" | tail -n 1)"
fi

# --- what would travel to the device machine: the tree (tracked + untracked-not-ignored) and the wheels
if git rev-parse --git-dir >/dev/null 2>&1; then
  tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
  whl=$(du -cb "$WHEELS"/*.whl 2>/dev/null | tail -n 1 | cut -f1)
  total=$(( ${tree:-0} + ${whl:-0} ))
  limit=$(( 64 * 1024 * 1024 ))
  msg="tree $(( ${tree:-0} / 1024 )) KiB + wheels $(( ${whl:-0} / 1024 )) KiB = $(( total / 1024 )) KiB of 65536 KiB"
  if [ "$total" -le "$limit" ]; then step ok "travel size" "$msg"; else step error "travel size" "$msg: over the limit"; fi
fi

# --- versions
"$PY" - <<'EOF'
import importlib.metadata as md
import subprocess

import torch

def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
try:
    drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout.strip() or "unknown"
except OSError:
    drv = "no nvidia-smi"
print(f"gpu_run: GPU {gpu}; driver {drv}; CUDA {torch.version.cuda}; torch {torch.__version__}; "
      + "; ".join(f"{p} {v(p)}" for p in ("triton", "setuptools", "numpy", "pyarrow")))
EOF

# --- the parts
LEFT=$(( BUDGET - ($(date +%s) - START) ))
SIZE=full
if [ $REHEARSE = 1 ]; then
  SIZE=rehearse
  # DeepSpeed's CPU accelerator JIT-builds its shm op once per extensions folder: one per checkout, so that
  # checkouts with other virtual environments sharing ~/.cache do not rebuild it for each other
  export TRITON_INTERPRET=1 DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
fi
export PYTHONUNBUFFERED=1
"$PY" -m bench.gpu_suite --parts "$PARTS" --size "$SIZE" --flat --out "$OUTDIR" --budget "$LEFT" --steps 2 \
  --setup "$SETUP" "${PASS[@]}"
rc=$?
rm -f "$SETUP"
[ $rc = 0 ] && [ $FAILED = 1 ] && rc=1
files=$(find "$OUTDIR" -type f | wc -l)
echo "gpu_run: exit $rc after $(( $(date +%s) - START )) s; $files files under $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
exec >&- 2>&-
wait "$TEE" 2>/dev/null  # run.log complete before the call returns $OUT
exit $rc
