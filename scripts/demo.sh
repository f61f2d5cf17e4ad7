#!/usr/bin/env bash
# Set up a virtual environment and run the main job end to end on the built-in synthetic dataset:
# synthesize 100k z-scored 25x25 arrays of 5 classes, ingest them, print stats, train the CNN, score it.
# Extra arguments go to `lmdbstore demo` (e.g. -n 200000 --epochs 5 --dir /data/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
setup_venv "[torch]"
.venv/bin/lmdbstore demo "$@"
