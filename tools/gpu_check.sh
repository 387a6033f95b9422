#!/usr/bin/env bash
# Builds smp against this machine's python/torch (a GPU machine: torch 2.x + CUDA,
# maybe no .venv) in its own build dir and runs the GPU suite (tests/gpu) plus the
# build-info test. Usage: tools/gpu_check.sh [python]   (default: .venv/bin/python if
# present, else python3). See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
BUILD="${SMP_GPU_BUILD_DIR:-build-gpu}"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
          "gpus", torch.cuda.device_count())'
"$PY" -m pytest --version >/dev/null 2>&1 || "$PY" -m pip install -q pytest
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY")"
cmake --build "$BUILD" -j"$(nproc)"
PYTHONPATH="$BUILD/python" SMP_BUILD_DIR="$BUILD" "$PY" -m pytest -q \
  tests/python/test_build_info.py tests/gpu "$@"
