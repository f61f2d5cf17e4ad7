#!/usr/bin/env bash
# Set up a virtual environment and run the main job end to end on the built-in synthetic dataset:
# synthesize 100k z-scored 25x25 arrays of 5 classes, ingest them, print stats, train the CNN, score it.
# Extra arguments go to `lmdbstore demo` (e.g. -n 200000 --epochs 5 --dir /data/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e .
.venv/bin/lmdbstore demo "$@"
