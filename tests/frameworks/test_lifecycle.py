"""Nothing is left behind: no worker or reader process and no shared memory in /dev/shm, after SIGKILL,
SIGTERM or Ctrl-C (SIGINT) of the training process, after an early stop (break) and after garbage
collection, for make_loader, keras_dataset (torch, TensorFlow and JAX backends) and tf_dataset.

Each case runs lifecycle_script.py as a process of its own, marked by an environment variable that every
process it starts inherits: after the kill (or the script's own end), no process with the mark may remain
(within a few seconds: the workers' lifeline is immediate, the bound only absorbs a loaded machine), and no
file in /dev/shm may carry the pid of any of them.
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

SCRIPT = TESTS / "frameworks" / "lifecycle_script.py"
SHM = Path("/dev/shm")
#: Seconds the processes get to go after their owner ended: they go at once (this absorbs a loaded machine),
#: well before torch's own worker watchdog (5 s) would end DataLoader workers.
GONE_WITHIN = 3.0
#: Seconds the script may take to end (a killed one, or a ``drop`` run) before the test fails with its stacks.
ENDS_WITHIN = 150


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and /dev/shm")


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries ``mark``."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if f"LMDBSTORE_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    out.append(int(p))
        except OSError:
            pass
    return out


def _shm() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def _shm_of(pids: set[int], before: set[str]) -> list[str]:
    """Files in /dev/shm named with one of ``pids`` (lmdbstore's named segments, torch's, Python's), and
    lmdbstore segments that were not there ``before`` (on Linux lmdbstore never names one)."""
    now = _shm()
    mine = [n for n in now if any(str(p) in n.replace("-", "_").split("_") for p in pids)]
    return sorted(set(mine) | {n for n in now - before if n.startswith("lmdbstore-")})


def run_case(store: Path, kind: str, mode: str, sig: signal.Signals | None = None, backend: str = "torch") -> None:
    """Run the script, kill it with ``sig`` once batches flow (``mode="wait"``) or let it end (``"drop"``),
    then assert that nothing it started is left."""
    mark = uuid.uuid4().hex
    before = _shm()
    env = {
        **os.environ,
        "LMDBSTORE_TEST_MARK": mark,
        "KERAS_BACKEND": backend,
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
            seen.update(_marked(mark))
            assert len(seen) >= 3, f"expected the script and its workers, saw {seen}"  # script + 2 workers at least
            assert sig is not None
            proc.send_signal(sig)
        out, err = _wait_for_end(proc, sig, again=sig == signal.SIGINT and backend == "jax")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if mode == "drop":
        assert proc.returncode == 0 and "CLEAN" in out, (out + err)[-3000:]
    deadline = time.monotonic() + GONE_WITHIN
    left = _marked(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _marked(mark)
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} processes left {GONE_WITHIN} s after the script ended"
    seen.add(proc.pid)
    assert not _shm_of(seen, before), _shm_of(seen, before)


def _wait_for_end(proc: subprocess.Popen[str], sig: signal.Signals | None, *, again: bool) -> tuple[str, str]:
    """The script's output once it ended; with ``again``, Ctrl-C is pressed again every 5 s meanwhile.

    Keras on JAX sometimes loses the first KeyboardInterrupt on a loaded machine: ``model.fit`` trains on
    for minutes, or for good (reproduced on 2 loaded cores with a plain ``PyDataset`` of random arrays and no
    lmdbstore at all); a second Ctrl-C ends it, as it would for a user.  A script that does not end within
    :data:`ENDS_WITHIN` fails the test with its threads' stacks."""
    deadline = time.monotonic() + ENDS_WITHIN
    while True:
        try:
            return proc.communicate(timeout=5 if again else ENDS_WITHIN)
        except subprocess.TimeoutExpired:
            if again and sig is not None and time.monotonic() < deadline:
                proc.send_signal(sig)
                continue
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


@pytest.mark.skipif(not _installed("tensorflow"), reason="tensorflow is not installed (lmdbstore[frameworks])")
@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.slow)], ids=lambda s: s.name
)
def test_tf_dataset_readers_die_with_the_process(small_store: StoreInfo, sig: signal.Signals) -> None:
    """By forkserver (TensorFlow's runtime runs): SIGKILL, and Ctrl-C, which TensorFlow's iterators see.  SIGTERM
    ends readers through the same lifeline as SIGKILL (the loader's SIGTERM case)."""
    run_case(small_store.path, "tf", "wait", sig)


@pytest.mark.skipif(not _installed("tensorflow"), reason="tensorflow is not installed (lmdbstore[frameworks])")
def test_tf_dataset_leaves_nothing_after_early_stop_and_collection(small_store: StoreInfo) -> None:
    run_case(small_store.path, "tf", "drop")


BACKENDS = ["torch", "tensorflow", "jax"]


#: One feed under every backend, and one lifeline: SIGKILL and SIGTERM end the readers of ``make_loader`` (and
#: SIGKILL those of ``tf_dataset``) above through the same code; Ctrl-C, which each backend's loop handles its own
#: way, is checked on every one.
KERAS_CASES = [(b, signal.SIGINT) for b in BACKENDS]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "sig"), KERAS_CASES, ids=lambda v: v if isinstance(v, str) else v.name)
def test_keras_dataset_readers_die_with_the_process(small_store: StoreInfo, backend: str, sig: signal.Signals) -> None:
    if not _installed("keras", backend):
        pytest.skip(f"keras or {backend} is not installed")
    run_case(small_store.path, "keras", "wait", sig, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_dataset_leaves_nothing_after_early_stop_and_collection(small_store: StoreInfo, backend: str) -> None:
    if not _installed("keras", backend):
        pytest.skip(f"keras or {backend} is not installed")
    run_case(small_store.path, "keras", "drop", backend=backend)
