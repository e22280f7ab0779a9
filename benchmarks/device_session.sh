#!/usr/bin/env bash
# The GPU checks of a session that is lent a device machine (one H100 / H200), in as few calls as its 30 minutes
# allow. The machine's image has torch (CUDA), transformers, accelerate, peft, pytest-xdist; diffusers,
# ml-collections and uvicorn travel as wheels in the git-ignored .whl/ (the versions of this venv).
#
#   here, once:     bash benchmarks/device_session.sh download
#   on the device (the `run` tool, carry [".whl"], each under its 10-minute limit):
#                   bash benchmarks/device_session.sh tests                        # pytest -n 14, log + junit in $OUT
#                   bash benchmarks/device_session.sh gpu-check [gpu_check args]   # JSON + log in $OUT
#                   bash benchmarks/device_session.sh activation-memory [args]     # JSON + log in $OUT
#                   CPU_JOB=... bash benchmarks/device_session.sh lease             # all in one call (see below)
#
# A plan for a 30-minute lease (one run at a time, 10 minutes a call; the first call also starts the machine):
#   1. tests                                                        the CUDA suite (issue: 0 failed, 0 errors)
#   2. gpu-check --arch sd15 --dtypes fp16                          exactness, sampling, peaks vs the targets
#   3. gpu-check --arch sd35 --dtypes bf16 --variants grpo,group_ppo,nft,awm
#   4. gpu-check --arch sd15 --dtypes fp16 --variants grpo,ddpo,group_ppo --gradient-checkpointing
# Each call's files come back from $OUT before the next empties it.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
shift || true
OUT=${OUT:-/tmp/device_out}

install_wheels() {
  mkdir -p "$OUT"
  # diffusers, ml-collections and uvicorn always (this venv's versions); any other wheel only when the image lacks it
  local wheels
  wheels=$(python3 - <<'PY'
import glob, importlib.metadata as m, os
for path in sorted(glob.glob(".whl/*.whl")):
    name = os.path.basename(path).split("-")[0].replace("_", "-").lower()
    try:
        m.version(name)
        present = name not in ("diffusers", "ml-collections", "uvicorn")
    except m.PackageNotFoundError:
        present = False
    if not present:
        print(path)
PY
)
  [ -n "$wheels" ] || { echo "device_session: no .whl/*.whl (run 'download' here and carry .whl)"; exit 1; }
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    || { echo "device_session: could not install .whl/*.whl (run 'download' here and carry .whl)"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
}

case "$what" in
  download)
    version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
    mkdir -p .whl
    # the core's three, and the dev extra's packages a CUDA image may lack (each installed there only when missing)
    for name in diffusers ml-collections uvicorn rapidfuzz openai httpx2 httpcore2 truststore jiter anyio sniffio h11 \
        pydantic pydantic-core annotated-types typing-inspection scipy hypothesis sortedcontainers; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$name==$(version "$name")" || exit 1
    done
    ls -la .whl
    ;;
  tests)
    install_wheels
    timeout 560 python3 -m pytest -n 14 -q -p no:cacheprovider --junitxml "$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/tests.log"
    ;;
  gpu-check)
    install_wheels
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
    timeout 580 python3 benchmarks/gpu_check.py --output "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
    ;;
  scenes-pretrain)
    # The scenes bases' scaling table on the GPU (benchmarks/scenes_scaling.py, every (arch, size) at once for
    # MINUTES each), then every run's pipeline with its float32 weights stored as float16 (the call returns 64 MiB at
    # most; tools/unpack in docs/scenes.md), logs, samples and scaling.json, as one tar cut in 15 MB parts.
    install_wheels
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
    timeout "${SCALING_SECONDS:-480}" python3 benchmarks/scenes_scaling.py --device cuda --minutes "${MINUTES:-4.5}" \
      --out /tmp/scaling "$@" 2>&1 | tee "$OUT/scaling.log"
    python3 - <<'PY'
import os, shutil, torch
from safetensors.torch import load_file, save_file
src, dst = "/tmp/scaling", "/tmp/pack"
for root, dirs, files in os.walk(src):
    if os.path.relpath(root, src).split(os.sep)[0] == "state":
        continue
    for name in files:
        path = os.path.join(root, name)
        target = os.path.join(dst, os.path.relpath(path, src))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            save_file({k: v.half() if v.dtype == torch.float32 else v for k, v in tensors.items()}, target)
        else:
            shutil.copy(path, target)
PY
    tar -C /tmp/pack -cf /tmp/scaling.tar . && split -b 15M /tmp/scaling.tar "$OUT/scaling.tar.part-"
    ls -la "$OUT"
    ;;
  lease)
    # Everything in one call, for a lease of 15 minutes of device time (about 9 of them one command's): CPU_JOB (a
    # shell command, e.g. a study's single-thread runs, stopped with its process group after CPU_SECONDS (default
    # 500); then CPU_COLLECT, a command that copies what it wants to keep to $CPU_OUT = $OUT/cpu)
    # runs in the background on the cores the GPU leaves, beside the CUDA tests and three GPU checks one after
    # another: SD-1.5 fp16 (every variant; issues 21, 22, 25's targets), SD3.5 bf16, and SDXL + Wan bf16 with the
    # 1-process FSDP2 row. Each has its own timeout; what finishes comes back.
    install_wheels
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
    cpu_pid=""
    if [ -n "${CPU_JOB:-}" ]; then
      mkdir -p "$OUT/cpu"
      # CPU_COLLECT right after the job's own timeout, whatever the GPU checks are doing (the call's limit may
      # come first)
      ( CPU_OUT="$OUT/cpu" timeout "${CPU_SECONDS:-500}" bash -c "$CPU_JOB" > "$OUT/cpu/job.log" 2>&1
        echo "cpu job: exit $? ($(date -u +%T))" >> "$OUT/cpu/job.log"
        [ -z "${CPU_COLLECT:-}" ] || CPU_OUT="$OUT/cpu" bash -c "$CPU_COLLECT" ) &
      cpu_pid=$!
    fi
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_precision.py tests/test_config.py \
      --junitxml "$OUT/junit.xml" 2>&1 | tail -5 | tee "$OUT/tests.log"
    check() {  # check NAME SECONDS ARGS...
      local name=$1 seconds=$2
      shift 2
      OMP_NUM_THREADS=2 timeout "$seconds" python3 benchmarks/gpu_check.py --output "$OUT/gpu_check_$name.json" "$@" > "$OUT/gpu_check_$name.log" 2>&1
      echo "gpu_check $name: exit $? ($(date -u +%T))"
    }
    check sd15 ${SD15_SECONDS:-200} --arch sd15 --dtypes fp16
    check sd35 ${SD35_SECONDS:-130} --arch sd35 --dtypes bf16 --variants grpo,group_ppo
    check sdxl_wan ${SDXL_WAN_SECONDS:-130} --arch sdxl,wan --dtypes bf16 --variants grpo --fsdp2 1
    [ -z "$cpu_pid" ] || wait "$cpu_pid"
    ;;
  activation-memory)
    install_wheels
    timeout 580 python3 benchmarks/activation_memory.py --output "$OUT/activation_memory.json" "$@" 2>&1 \
      | tee "$OUT/activation_memory.log"
    ;;
  *)
    echo "usage: bash benchmarks/device_session.sh download | tests [pytest args] | gpu-check [args] | activation-memory [args] | lease"
    exit 2
    ;;
esac
