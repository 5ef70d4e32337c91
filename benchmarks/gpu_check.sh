#!/usr/bin/env bash
# The one script to run when the device tool lends a GPU (at most ~9 minutes). It runs on the lent machine's
# own python3 (which holds torch, triton and transformers); the few packages vlmserve imports and
# that image lacks travel as wheels in .gpu_wheels/, which `benchmarks/gpu_check.sh --prepare` fills here
# (pip download; the folder is git-ignored, so name it in the device tool's `carry`).
#
#   here:   benchmarks/gpu_check.sh --prepare
#   there:  benchmarks/gpu_check.sh [sections...]   (kernels bf16 e2e syncs serve encoder; default all)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wheels=.gpu_wheels
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$wheels"
  # the lent machine's python3 is CPython 3.12 (the device notes): wheels for it, whatever python runs here, at
  # the versions this venv runs (installed there without their dependencies). Its image lacks these: redis, and
  # the server's (the serve section); it holds every other package the checks import (transformers, xxhash…).
  pins=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
names = ["redis", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "uvicorn"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
  # shellcheck disable=SC2086
  .venv/bin/python -m pip download --no-deps -q -d "$wheels" --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 $pins
  grep -qx "/$wheels/" .git/info/exclude 2>/dev/null || echo "/$wheels/" >> .git/info/exclude
  ls "$wheels"
  exit 0
fi
py=python3
missing=$($py - <<'PY'
import importlib.util as u
need = ("torch", "triton", "transformers", "redis", "xxhash", "jinja2", "tokenizers", "safetensors", "fastapi", "uvicorn")
print(" ".join(m for m in need if u.find_spec(m) is None))
PY
)
if [ -n "$missing" ] && [ -d "$wheels" ]; then
  echo "[gpu_check] installing carried wheels for: $missing" >&2
  $py -m pip install --no-index --no-deps -q "$wheels"/*.whl 2>&1 | tail -3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
export PYTHONUNBUFFERED=1 VLMSERVE_KERNEL_CACHE="${TMPDIR:-/tmp}/vlmserve-kernels"
timeout 360 $py benchmarks/gpu_check.py "$@"
rc=$?
if [ $# -eq 0 ] || [[ " $* " == *" encoder "* ]]; then
  # the encoder throughput on the GPU (our tower against transformers', bf16 as the engine resolves it)
  for family in qwen2_vl qwen2_5_vl; do
    timeout 90 $py benchmarks/encoder_throughput.py --quick --device cuda --family "$family" || rc=1
  done
  # the device tool returns what lands in $OUT (there only)
  [ -n "${OUT:-}" ] && cp benchmarks/results/encoder_throughput/*-cuda.json "$OUT"/ 2>/dev/null
fi
exit $rc
