"""The Keras PyDataset and the tf.data factory with the real packages (the ``frameworks`` test extra): the steps of
framework_checks.py run in one process per Keras backend, once per module (TensorFlow must not be loaded into
the test process, where later tests fork DataLoader workers, and each process that imports it costs seconds of
CPU); each test asserts its step's result.  The process is marked by an environment variable that every process
it starts inherits: its Ctrl-C steps are pressed here once batches flow, the last one ends it, and then no
process it started and no file in /dev/shm of theirs may be left (leftovers.py).  Skipped when the packages
are not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, TESTS, build_store, damage_store, default_sigint, make_data
from framework_checks import PLANS
from leftovers import left_behind, marked, shm

CHECKS = TESTS / "frameworks" / "framework_checks.py"
#: Seconds a step may run without a word before the run fails with the script's stacks.
STEP_WITHIN = 300
#: Seconds the script may take to end after its last Ctrl-C.
ENDS_WITHIN = 150

pytestmark = pytest.mark.slow
Results = Callable[[str], dict[str, Any]]


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """``results(backend)``: the error of each step of the backend's run (``None``: passed), and under
    ``"end"`` what the run left behind or how it failed to end; the run happens on the first call."""
    stores = tmp_path_factory.mktemp("frameworks")
    build_store(stores / "small", *make_data(2000, 1234))  # conftest's small_store
    for name, how in (("damaged", "garble_leaf"), ("truncated", "truncate")):
        damage_store(build_store(stores / name, *make_data(3000)), how)
    runs: dict[str, dict[str, Any]] = {}

    def get(backend: str) -> dict[str, Any]:
        if not _installed("keras", backend):
            pytest.skip(f"keras or {backend} is not installed (lmdbstore[frameworks])")
        if backend not in runs:
            runs[backend] = _run(backend, stores)
        return runs[backend]

    return get


def _run(backend: str, stores: Path) -> dict[str, Any]:
    """Run the backend's steps (see the module docstring)."""
    mark, before, plan = uuid.uuid4().hex, shm(), PLANS[backend]
    env = {
        **os.environ,
        "LMDBSTORE_TEST_MARK": mark,
        "KERAS_BACKEND": backend,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    out: dict[str, Any] = {}
    with open(stores / f"{backend}.stderr", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, str(CHECKS), backend, str(stores)],
            env=env, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=default_sigint,
        )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_lines, args=(proc, lines), daemon=True).start()
        seen = {proc.pid}
        try:
            out["end"] = _follow(proc, lines, plan, out, mark, seen, again=backend == "jax")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)  # its threads' stacks to stderr (faulthandler)
                time.sleep(2)
                proc.kill()
            proc.wait()
        err.seek(0)
        if out["end"] is not None:
            out["end"] += "\n" + err.read()[-6000:]
    out["end"] = out["end"] or left_behind(mark, seen, before)
    return out


def _lines(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def _follow(
    proc: subprocess.Popen[str],
    lines: queue.Queue[str | None],
    plan: list[str],
    out: dict[str, Any],
    mark: str,
    seen: set[int],
    *,
    again: bool,
) -> str | None:
    """Record the steps' results, press Ctrl-C at each ``READY``; how the run failed to end, or ``None``.

    Keras on JAX sometimes loses the first KeyboardInterrupt on a loaded machine: ``model.fit`` trains on for
    minutes, or for good (reproduced on 2 loaded cores with a plain ``PyDataset`` of random arrays and no
    lmdbstore at all); with ``again`` a last Ctrl-C is pressed again every 5 s until the script ends, as a user
    would."""
    pressed_last = None
    while True:
        wait = 5 if again and pressed_last else ENDS_WITHIN if pressed_last else STEP_WITHIN
        try:
            line = lines.get(timeout=wait)
        except queue.Empty:
            if pressed_last and again and time.monotonic() - pressed_last < ENDS_WITHIN:
                proc.send_signal(signal.SIGINT)
                continue
            return f"no word from the script for {wait} s after {sorted(out)}"
        if line is None:
            break
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            out[result["step"]] = result["error"]
        elif line.startswith("READY"):
            seen.update(marked(mark))
            if len(seen) < 3:  # the script and 2 readers at least
                return f"expected the script and its readers once batches flow, saw {seen}"
            proc.send_signal(signal.SIGINT)
            if len(out) == len(plan) - 1:
                pressed_last = time.monotonic()
    if pressed_last is None:
        return f"the script ended before its last Ctrl-C (exit {proc.wait()}), after {sorted(out)}"
    out[plan[-1]] = None  # ended by Ctrl-C
    return None


def _passed(results: Results, backend: str, *steps: str) -> None:
    got = results(backend)
    for step in steps:
        assert step in got, f"{step} did not run: {got['end']}"
        assert got[step] is None, got[step]


TF = pytest.mark.skipif(not _installed("tensorflow"), reason="tensorflow is not installed (lmdbstore[frameworks])")
BACKENDS = ["tensorflow", "torch", "jax"]


@TF
def test_tf_dataset(results: Results) -> None:
    _passed(results, "tensorflow", "tf")


@TF
def test_tf_dataset_errors(results: Results) -> None:
    _passed(results, "tensorflow", "tf_error")


@TF
def test_tf_dataset_delivers_a_transforms_shape_and_dtype(results: Results) -> None:
    _passed(results, "tensorflow", "tf_transforms")


@TF
def test_tf_dataset_leaves_nothing_after_early_stop_and_collection(results: Results) -> None:
    _passed(results, "tensorflow", "drop_tf")


@TF
def test_tf_dataset_readers_die_with_the_process_on_ctrl_c(results: Results) -> None:
    """By forkserver (TensorFlow's runtime runs); SIGKILL: test_lifecycle.py."""
    _passed(results, "tensorflow", "interrupt_tf", "end")


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_dataset_under_model_fit(results: Results, backend: str) -> None:
    _passed(results, backend, "keras")


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_dataset_delivers_a_transforms_shape_and_dtype(results: Results, backend: str) -> None:
    _passed(results, backend, "keras_transforms")


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_model_fit_on_make_loader_gets_a_new_order_every_epoch(results: Results, backend: str) -> None:
    _passed(results, backend, "keras_make_loader")


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_dataset_leaves_nothing_after_early_stop_and_collection(results: Results, backend: str) -> None:
    _passed(results, backend, "drop_keras")


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_dataset_readers_die_with_the_process_on_ctrl_c(results: Results, backend: str) -> None:
    """Ctrl-C, which each backend's loop handles its own way (SIGKILL and SIGTERM end the readers through the
    same lifeline as make_loader's: test_lifecycle.py)."""
    _passed(results, backend, "interrupt_keras", "end")
