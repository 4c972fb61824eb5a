#!/usr/bin/env bash
# The GPU check: one prepared run on a single-GPU machine (written for one H200) that has torch,
# transformers and triton but no megatron-core, Transformer Engine, TensorRT-LLM or vLLM, and no
# network. It installs from wheels in .whl/, runs the `gpu`-marked tests and the two GPU
# benchmarks, and ends with one summary table. Everything fits in GPU_CHECK_BUDGET_S (default
# 840 s, under 15 minutes with the installs); each step has its own timeout, cut to what is left.
#
# Nothing is created outside the repository: the installed wheels (on PYTHONPATH, ahead of the
# machine's packages), logs, results, caches, HOME and TMPDIR all live in .gpu-check/ (ignored
# by git).
#
# Wheels: put them in .whl/ (ignored by git) on a machine with network, for the GPU machine's
# Python (3.12 on the H200 machines): the project's requirements that machine lacks or has in
# another version, without their dependencies (the machine's own torch, numpy, scipy, ... stay):
#   pip download -d .whl/ --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 megatron-core==0.16.1 omegaconf==2.3.1 hydra-core==1.3.8 \
#     bm25s==0.3.16 faiss-cpu==1.15.1 transformers==5.24.0 tokenizers==0.23.3 \
#     huggingface_hub==2.4.0 httpx2==2.6.0 httpcore2==2.6.0 truststore==0.10.5 idna==3.20 \
#     click==8.5.1 regex==2026.11.19 hf-xet==1.8.0 pydantic==2.14.4 pydantic_core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5
#   pip wheel -w .whl/ --no-deps antlr4-python3-runtime==4.9.3   (an sdist on PyPI)
# (about 46 MB: it fits the 64 MiB a device call carries). Every wheel there (but a torch
# wheel: the machine's CUDA torch stays) is installed with --no-deps, then the imports are
# checked. Optional, each with all of its dependencies the machine lacks (a library that does
# not import is reported and its tests skip):
#   transformer_engine, transformer_engine_cu12, transformer_engine_torch  (Transformer Engine;
#     transformer_engine_torch is built against the machine's torch, e.g. in an NGC container)
#   tensorrt_llm  (TensorRT-LLM, NVIDIA's index)
#   vllm
# These are hundreds of MB each: more than one device call carries.
#
# Usage: bash scripts/gpu_check.sh    (PYTHON=python3.12 to pick the interpreter)
# Exit code: 0 when the required steps, the tests and both benchmarks succeeded; 1 otherwise.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
WHEELS=$REPO/.whl
WORK=$REPO/.gpu-check
PYTHON=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-840}
DEADLINE=$((SECONDS + BUDGET_S))
SITE=$WORK/site
PY=$PYTHON
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
                f"the measured bf16 matmul peak {peak:.0f} TFLOP/s), {row['layer_spec']} spec, "
                f"resident {row['resident_gib']:.1f} GiB (plan {row['plan_resident_gib']:.1f}), "
                f"activations {row['activation_peak_gib']:.1f} GiB "
                f"(plan {row['plan_activation_gib']:.1f})")
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

# --- the environment: the machine's python, torch, numpy, ... with the wheels on PYTHONPATH ---
# No virtual environment: a venv of the machine's interpreter (itself a venv) would not see its
# torch. The wheels go into $SITE with --no-deps, ahead of the machine's packages on PYTHONPATH,
# and the repository is imported from its checkout.
start=$SECONDS
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  record "cuda" "FAILED" 0 "$PYTHON: torch missing or no CUDA GPU visible"
  exit 1
fi
record "cuda" "ok" $((SECONDS - start)) "$("$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")')"
WHEEL_FILES=()
for wheel in "$WHEELS"/*.whl; do
  case ${wheel##*/} in
    torch-*) ;;  # the machine's CUDA torch stays
    *) [[ -e $wheel ]] && WHEEL_FILES+=("$wheel") ;;
  esac
done
rm -rf "$SITE"
if ((${#WHEEL_FILES[@]})); then
  run_step install-wheels 240 required "$PYTHON" -m pip install -q --no-index --no-deps \
    --no-compile --target "$SITE" "${WHEEL_FILES[@]}"
else
  record "install-wheels" "skipped" 0 "no wheels in $WHEELS: only the machine's packages"
fi
export PYTHONPATH=$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}
run_step imports 60 required "$PY" -c 'import importlib.metadata as m, faiss, bm25s, megatron.core
import nemo_orch.cli, nemo_orch.train.policy, transformers, torch
print(*(f"{name} {m.version(name)}" for name in ("torch", "megatron-core", "transformers",
      "numpy", "faiss-cpu")), sep=", ")'
for library in transformer_engine.pytorch tensorrt_llm vllm; do
  if "$PY" -c "import $library" > /dev/null 2>&1; then
    record "import-${library%%.*}" "ok" 0 "importable: its GPU tests and benchmark rows run"
  else
    record "import-${library%%.*}" "skipped" 0 "not importable (no wheel in .whl/?): its tests skip"
  fi
done

# --- the checks -----------------------------------------------------------------------------
# Only the modules that hold GPU tests are collected: the others import CPU-only extras (Ray,
# PyTriton, NeMo-Run) this environment does not install.
mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
run_step pytest-gpu 300 check "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${GPU_TESTS[@]}"
# Batch 4: without recompute, the local spec's unfused attention at batch 8 x 2048 tokens
# needs more than an H200's 140 GiB.
run_step train-step 240 check "$PY" benchmarks/gpu_train_step.py --steps 5 --warmup 2 \
  --batch-size 4 \
  --json "$WORK/results/train.json"
run_step generation 240 check "$PY" benchmarks/gpu_generation.py --workdir "$WORK/generation" \
  --json "$WORK/results/generation.json"

exit "$FAILED"
