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
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_session: could not install .whl/*.whl (run 'download' here and carry .whl)"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
}

case "$what" in
  download)
    version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
    mkdir -p .whl
    for name in diffusers ml-collections uvicorn; do
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
  activation-memory)
    install_wheels
    timeout 580 python3 benchmarks/activation_memory.py --output "$OUT/activation_memory.json" "$@" 2>&1 \
      | tee "$OUT/activation_memory.log"
    ;;
  *)
    echo "usage: bash benchmarks/device_session.sh download | tests [pytest args] | gpu-check [args] | activation-memory [args]"
    exit 2
    ;;
esac
