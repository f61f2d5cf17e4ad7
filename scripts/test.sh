#!/usr/bin/env bash
# Set up a virtual environment and run the test suite (what CI runs via .ci/run).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
setup_venv "[dev]"
.venv/bin/python -m pytest -q "$@"
