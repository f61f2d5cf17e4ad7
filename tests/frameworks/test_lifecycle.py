"""Nothing is left behind: no worker or reader process and no shared memory in /dev/shm, after SIGKILL,
SIGTERM or Ctrl-C (SIGINT) of the training process, after an early stop (break) and after garbage
collection, for make_loader, and after SIGKILL for tf_dataset (readers started by forkserver).  The same for
keras_dataset on every backend and tf_dataset's Ctrl-C and early stop: test_keras_tf.py, in its one process
per backend.

Each case runs lifecycle_script.py as a process of its own, marked by an environment variable that every
process it starts inherits: after the kill (or the script's own end), no process with the mark may remain
(within a few seconds: the workers' lifeline is immediate, the bound only absorbs a loaded machine), and no
file in /dev/shm may carry the pid of any of them (leftovers.py).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, TESTS, StoreInfo, default_sigint
from leftovers import left_behind, marked, shm

SCRIPT = TESTS / "frameworks" / "lifecycle_script.py"
#: Seconds the script may take to end (a killed one, or a ``drop`` run) before the test fails with its stacks.
ENDS_WITHIN = 150


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /dev/shm")


def run_case(store: Path, kind: str, mode: str, sig: signal.Signals | None = None) -> None:
    """Run the script, kill it with ``sig`` once batches flow (``mode="wait"``) or let it end (``"drop"``),
    then assert that nothing it started is left."""
    mark = uuid.uuid4().hex
    before = shm()
    env = {
        **os.environ,
        "LMDBSTORE_TEST_MARK": mark,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), kind, mode, str(store)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
    )  # fmt: skip
    seen: set[int] = set()
    try:
        assert proc.stdout is not None
        if mode == "wait":
            for line in proc.stdout:
                if "READY" in line:
                    break
            seen.update(marked(mark))
            assert len(seen) >= 3, f"expected the script and its workers, saw {seen}"  # script + 2 workers at least
            assert sig is not None
            proc.send_signal(sig)
        out, err = _wait_for_end(proc, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if mode == "drop":
        assert proc.returncode == 0 and "CLEAN" in out, (out + err)[-3000:]
    seen.add(proc.pid)
    left = left_behind(mark, seen, before)
    assert left is None, left


def _wait_for_end(proc: subprocess.Popen[str], sig: signal.Signals | None) -> tuple[str, str]:
    """The script's output once it ended; one that does not end within :data:`ENDS_WITHIN` fails the test with
    its threads' stacks."""
    try:
        return proc.communicate(timeout=ENDS_WITHIN)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # its threads' stacks to stderr (faulthandler), then the failure
        time.sleep(2)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the script did not end {ENDS_WITHIN} s after {sig!r}:\n{err[-6000:]}")


KILLS = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT]


@pytest.mark.parametrize("sig", KILLS, ids=lambda s: s.name)
def test_make_loader_workers_die_with_the_process(small_store: StoreInfo, sig: signal.Signals) -> None:
    run_case(small_store.path, "loader", "wait", sig)


def test_make_loader_leaves_nothing_after_early_stop_and_collection(small_store: StoreInfo) -> None:
    run_case(small_store.path, "loader", "drop")


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed (lmdbstore[frameworks])"
)
def test_tf_dataset_readers_die_with_the_process(small_store: StoreInfo) -> None:
    """By forkserver (TensorFlow's runtime runs), SIGKILL; SIGTERM ends readers through the same lifeline (the
    loader's SIGTERM case); Ctrl-C: test_keras_tf.py."""
    run_case(small_store.path, "tf", "wait", signal.SIGKILL)
