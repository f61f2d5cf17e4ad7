#!/usr/bin/env bash
# Set up a virtual environment and run the test suite (what CI runs via .ci/run).
# Extra arguments go to pytest.  The [frameworks] extra (TensorFlow CPU, Keras, Lightning, torchdata,
# TensorBoard) is installed too: the tests of the Keras, tf.data, Lightning and torchdata paths use them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
setup_venv "[dev,torch,frameworks]"
.venv/bin/python -m pytest -q "$@"
