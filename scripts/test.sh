#!/usr/bin/env bash
# Set up a virtual environment and run the test suite (what CI runs via .ci/run).
# TORCH_SPEC picks the torch to install; the default pins 2.13.0, which on the project's CI machines is a
# local CPU build (no multi-GB CUDA download). On your machine `TORCH_SPEC=torch` takes whatever pip resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -m pytest -q "$@"
