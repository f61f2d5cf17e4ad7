#!/usr/bin/env bash
# Set up a virtual environment and run the test suite (what CI runs via .ci/run).
# Extra arguments go to pytest (they come last, so `-n 0` runs in one process, `-m slow` only the slow tests).
# The [frameworks] extra (TensorFlow CPU, Keras, Lightning, torchdata, TensorBoard) is installed too: the tests
# of the Keras, tf.data, Lightning and torchdata paths use them.
# pytest-xdist runs one worker per core and one more (many tests wait on the processes they start; at most 8;
# TEST_WORKERS=N sets it, TEST_WORKERS=0 runs in this process); tests/conftest.py puts the test files holding
# slow tests first and keeps every process on one compute thread.  `--dist loadscope` hands out whole test files
# (in that order: --no-loadscope-reorder), so a module-scoped fixture (a torchrun job, a TensorFlow process, a
# workspace of stores) runs once, not once per worker that got some of the file's tests (worksteal split
# test_placement.py's and test_distributed.py's torchrun jobs over two workers: ~30 s of CPU twice).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
setup_venv "[dev,torch,frameworks]"
workers=${TEST_WORKERS:-$(($(nproc) + 1))}
((workers > 8)) && workers=8
.venv/bin/python -m pytest -q -n "$workers" --dist loadscope --no-loadscope-reorder --durations=15 "$@"
