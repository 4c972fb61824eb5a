#!/usr/bin/env bash
# The GPU check: one prepared run on a single-GPU machine (written for one H200) that has torch,
# transformers and triton but no megatron-core, Transformer Engine, TensorRT-LLM or vLLM, and no
# network. It installs from wheels in .whl/, runs the `gpu`-marked tests and the two GPU
# benchmarks, and ends with one summary table. Everything fits in GPU_CHECK_BUDGET_S (default
# 840 s, under 15 minutes with the installs); each step has its own timeout, cut to what is left.
#
# Nothing is created outside the repository: the virtual environment (on top of the machine's
# packages), logs, results, caches, HOME and TMPDIR all live in .gpu-check/ (ignored by git).
#
# Wheels: put them in .whl/ (ignored by git) on a machine with network and the GPU machine's
# Python version, e.g.
#   pip download -d .whl/ --only-binary=:all: -r requirements.txt setuptools wheel
#   (then delete the torch wheel: the machine's CUDA torch is kept)
# and, each optional (a missing one is skipped, with a message):
#   transformer_engine, transformer_engine_cu12, transformer_engine_torch  (Transformer Engine;
#     transformer_engine_torch is built against the machine's torch, e.g. in an NGC container)
#   tensorrt_llm and its dependencies  (TensorRT-LLM, NVIDIA's index)
#   vllm and its dependencies
# Optional packages are installed with the machine's torch pinned: a wheel that needs another
# torch is reported as not installable rather than replacing it.
#
# Usage: bash scripts/gpu_check.sh    (PYTHON=python3.11 to pick the interpreter)
# Exit code: 0 when the required steps, the tests and both benchmarks succeeded; 1 otherwise.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
WHEELS=$REPO/.whl
WORK=$REPO/.gpu-check
PYTHON=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-840}
DEADLINE=$((SECONDS + BUDGET_S))
VENV=$WORK/venv
PY=$VENV/bin/python
STEPS=$WORK/steps.tsv
FAILED=0

rm -rf "$WORK/logs" "$WORK/results" "$WORK/tmp"
mkdir -p "$WORK/logs" "$WORK/results" "$WORK/cache" "$WORK/home" "$WORK/tmp"
: > "$STEPS"
# Every cache, config and temporary file the tools write goes under .gpu-check/.
export HOME=$WORK/home TMPDIR=$WORK/tmp XDG_CACHE_HOME=$WORK/cache
export PYTHONPYCACHEPREFIX=$WORK/cache/pycache HF_HOME=$WORK/cache/huggingface
export TRITON_CACHE_DIR=$WORK/cache/triton TORCHINDUCTOR_CACHE_DIR=$WORK/cache/inductor
export VLLM_CACHE_ROOT=$WORK/cache/vllm CUDA_CACHE_PATH=$WORK/cache/nv
export MPLCONFIGDIR=$WORK/cache/matplotlib
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
export PYTHONUNBUFFERED=1

record() {  # name, status, seconds, note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4//$'\t'/ }" >> "$STEPS"
}

summary() {
  echo
  echo "== GPU check summary ($(date -u +%FT%TZ), ${SECONDS}s of ${BUDGET_S}s budget)"
  "$PYTHON" - "$STEPS" "$WORK/results" <<'EOF'
import json, sys
from pathlib import Path

rows = [line.split("\t") for line in Path(sys.argv[1]).read_text().splitlines() if line]
results = Path(sys.argv[2])
train = results / "train.json"
if train.exists():
    data = json.loads(train.read_text())
    peak = data["peak_bf16_flops"] / 1e12
    for row in data["rows"]:
        note = (f"failed: {row['error']}" if row["error"] else
                f"{row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%} (6*N*tokens/s over "
                f"the measured bf16 matmul peak {peak:.0f} TFLOP/s), {row['layer_spec']} spec")
        rows.append([f"  train {row['precision']}", "failed" if row["error"] else "ok", "", note])
generation = results / "generation.json"
if generation.exists():
    data = json.loads(generation.read_text())
    for engine, reason in data["failed_to_start"].items():
        rows.append([f"  generate {engine}", "failed", "", f"did not start: {reason}"])
    for row in data["rows"]:
        note = (f"failed: {row['error']}" if row["error"] else
                f"{row['tokens_per_s']:,.0f} tokens/s ({row['generated_tokens']} tokens in "
                f"{row['seconds']:.2f} s)")
        rows.append([f"  generate {row['engine']} batch {row['batch_size']}",
                     "failed" if row["error"] else "ok", "", note])
print("| step | status | s | notes |")
print("|---|---|---:|---|")
for name, status, seconds, note in rows:
    print(f"| {name} | {status} | {seconds} | {note} |")
EOF
  echo "logs: $WORK/logs/"
}
trap summary EXIT

# run_step NAME LIMIT_S KIND COMMAND...: KIND is required (stop on failure), check (record the
# failure, exit 1 at the end) or optional (record it only). Output goes to the terminal and a log.
run_step() {
  local name=$1 limit=$2 kind=$3
  shift 3
  local left=$((DEADLINE - SECONDS))
  if ((left < 15)); then
    record "$name" "skipped" 0 "time budget spent"
    [[ $kind == optional ]] || FAILED=1
    return 0
  fi
  ((limit > left)) && limit=$left
  local log=$WORK/logs/$name.log start=$SECONDS rc
  echo "== $name (limit ${limit}s, log $log)"
  set +e
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  local took=$((SECONDS - start))
  if ((rc == 0)); then
    record "$name" "ok" "$took" "$(tail -n 1 "$log" | cut -c1-160)"
    return 0
  fi
  local status="FAILED (exit $rc)"
  ((rc == 124 || rc == 137)) && status="TIMEOUT (${limit}s)"
  [[ $kind == optional ]] && status="$status, optional"
  record "$name" "$status" "$took" "$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-160)"
  case $kind in
    required) FAILED=1; echo "gpu_check: required step $name failed; stopping" >&2; exit 1 ;;
    check) FAILED=1 ;;
  esac
  return 0
}

# --- the environment: a venv on top of the machine's torch / transformers / triton ----------
start=$SECONDS
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  record "cuda" "FAILED" 0 "$PYTHON: torch missing or no CUDA GPU visible"
  exit 1
fi
if [[ ! -x $PY ]]; then
  if ! "$PYTHON" -m venv --system-site-packages "$VENV" > "$WORK/logs/venv.log" 2>&1; then
    # No ensurepip on this interpreter: a pip-less venv, driven by the machine's pip.
    rm -rf "$VENV"
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" >> "$WORK/logs/venv.log" 2>&1
  fi
fi
if "$PY" -m pip --version > /dev/null 2>&1; then
  PIP=("$PY" -m pip)
else
  PIP=("$PYTHON" -m pip --python "$PY")
fi
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
echo "torch==$TORCH_VERSION" > "$WORK/constraints.txt"
grep -v -E '^\s*(#|$|torch==)' requirements.txt > "$WORK/requirements.txt"
record "venv" "ok" $((SECONDS - start)) "$VENV (system site packages: torch $TORCH_VERSION)"
if [[ ! -d $WHEELS ]]; then
  echo "gpu_check: no $WHEELS directory; installing only what the machine already satisfies" >&2
fi
INSTALL=("${PIP[@]}" install --no-index --find-links "$WHEELS" -c "$WORK/constraints.txt")

run_step install-core 240 required "${INSTALL[@]}" megatron-core==0.16.1 -r "$WORK/requirements.txt"
BUILD_ISOLATION=()
"$PY" -c 'import setuptools' 2> /dev/null && BUILD_ISOLATION=(--no-build-isolation)
run_step install-repo 120 required "${INSTALL[@]}" --no-deps \
  ${BUILD_ISOLATION[@]+"${BUILD_ISOLATION[@]}"} -e "$REPO"

# install_optional NAME IMPORT REQUIREMENT WHEEL_GLOB LIMIT_S
install_optional() {
  local name=$1 module=$2 requirement=$3 glob=$4 limit=$5
  if "$PY" -c "import $module" 2> /dev/null; then
    record "install-$name" "ok" 0 "already installed"
  elif compgen -G "$WHEELS/$glob" > /dev/null; then
    run_step "install-$name" "$limit" optional "${INSTALL[@]}" "$requirement"
  else
    record "install-$name" "skipped" 0 "no $glob wheel in .whl/"
  fi
}
install_optional transformer-engine transformer_engine.pytorch "transformer_engine[pytorch]" \
  "transformer_engine*" 180
install_optional tensorrt-llm tensorrt_llm tensorrt_llm "tensorrt_llm*" 240

# --- the checks -----------------------------------------------------------------------------
run_step pytest-gpu 300 check "$PY" -m pytest -m gpu -q -p no:cacheprovider
run_step train-step 240 check "$PY" benchmarks/gpu_train_step.py --steps 5 --warmup 2 \
  --json "$WORK/results/train.json"
# vLLM last: it is the most likely to pull in different versions of shared packages.
install_optional vllm vllm vllm "vllm*" 180
run_step generation 240 check "$PY" benchmarks/gpu_generation.py --workdir "$WORK/generation" \
  --json "$WORK/results/generation.json"

exit "$FAILED"
