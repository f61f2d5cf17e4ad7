"""Producers for tests/ingestion/test_parallel.py and the task functions of tests/util/test_workers.py, in
their own module so spawned workers import them cheaply.

Every producer is deterministic per task.  ``x[k, 0, 0]`` encodes ``task_seed * 1000 + k``, so a test can
tell which task and which sample each stored sample came from.

Run as a script (``python parallel_tasks.py STORE N_TASKS WORKERS PRODUCER``) it calls
:func:`lmdbstore.write_parallel` the way a user's script would; the kill and Ctrl-C tests drive it.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPE = (4, 4)
CLASSES = ["a", "b", "c"]
#: Directory where producers that record their process id write one file per pid (set by tests).
PID_DIR_ENV = "LMDBSTORE_TEST_PID_DIR"


def task_data(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The ``(x, y)`` of task ``(seed, n)``: ``n`` samples."""
    seed, n = task
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *SHAPE)).astype(np.float32)
    x[:, 0, 0] = seed * 1000 + np.arange(n)
    return x, rng.integers(0, len(CLASSES), n)


def expected(tasks: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Everything ``tasks`` should put in a store, in order."""
    parts = [task_data(t) for t in tasks]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def produce(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    return task_data(task)


@functools.cache
def _reused_buffer(n: int) -> np.ndarray:
    return np.empty((n, *SHAPE), np.float32)


def produce_into_one_buffer(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`produce`, returning the same array object every time (refilled): a producer that reuses its
    output buffer, which a writer in its own process must copy before the next task runs."""
    x, y = task_data(task)
    buf = _reused_buffer(len(x))
    buf[:] = x
    return buf, y


def produce_with_inf(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`produce`, with an inf in sample 5 of task 0 (for stores that allow non-finite values)."""
    x, y = task_data(task)
    if task[0] == 0:
        x[5, 1, 1] = np.inf
    return x, y


def produce_chunks(task: tuple[int, int]):  # type: ignore[no-untyped-def]
    """Yields the same samples in two pieces, with labels as class names."""
    x, y = task_data(task)
    half = len(x) // 2
    names = np.asarray(CLASSES)[y]
    yield x[:half], names[:half]
    yield x[half:], names[half:]


def produce_slow(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`produce`, taking a while, recording this process's id under ``$LMDBSTORE_TEST_PID_DIR``."""
    pid_dir = os.environ.get(PID_DIR_ENV)
    if pid_dir:
        Path(pid_dir, str(os.getpid())).touch()
    time.sleep(0.02 + (task[0] % 3) * 0.01)
    return task_data(task)


GATE_AT = 20  # produce_gated: tasks from this index on wait for the test's go-ahead


def produce_gated(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`produce_slow`, but tasks from ``GATE_AT`` on touch ``waiting`` and then wait (up to 60 s)
    for a file ``go`` in ``$LMDBSTORE_TEST_PID_DIR``: a run cannot finish before the test has acted, however
    slowly the machine starts the workers."""
    pid_dir = Path(os.environ[PID_DIR_ENV])
    (pid_dir / str(os.getpid())).touch()
    if task[0] >= GATE_AT:
        (pid_dir / "waiting").touch()
        deadline = time.monotonic() + 60
        while not (pid_dir / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        time.sleep(0.01)
    return task_data(task)


def produce_fails_at_5(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    if task[0] == 5:
        raise RuntimeError("boom in task five")
    return task_data(task)


def produce_bad(task: tuple[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Task ``(kind, seed)``: a good result, or one with NaN, a wrong shape, dtype or label."""
    kind, seed = task
    x, y = task_data((seed, 8))
    if kind == "nan":
        x[3, 1, 1] = np.nan
    elif kind == "shape":
        x = x[:, :3]
    elif kind == "dtype":
        x = x.astype(np.float64)
    elif kind == "label":
        y[2] = 7
    elif kind == "none":
        return None  # type: ignore[return-value]
    return x, y


class Unpicklable:
    """A task with a stable repr that cannot be sent to a worker."""

    def __repr__(self) -> str:
        return "Unpicklable()"

    def __reduce__(self) -> Any:
        raise TypeError("Unpicklable cannot be pickled")


def mark_task(task: tuple[str, int]) -> int:
    """Task ``(directory, i)``: leaves ``task-<i>`` in the directory when it starts; returns ``2 * i``."""
    Path(task[0], f"task-{task[1]}").touch()
    return task[1] * 2


def square_after(task: tuple[int, float]) -> int:
    """Task ``(i, seconds)``: waits ``seconds``, then returns ``i * i`` (later tasks may finish first)."""
    time.sleep(task[1])
    return task[0] * task[0]


def raise_at_3(task: int) -> int:
    """Returns ``task``; task 3 raises ValueError."""
    if task == 3:
        raise ValueError("task three is bad")
    return task


def worker_pid(task: int) -> int:
    """The id of the process running the task (after a short wait, so every worker gets tasks)."""
    time.sleep(0.05)
    return os.getpid()


def kill_self_at_4(task: int) -> int:
    """Returns ``task``; the worker running task 4 kills itself with SIGKILL (as the OOM killer would).

    With a pool ``limit`` of 4, task 4 is handed out only after task 0's result was taken."""
    if task == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return task


def read_passed(passed: Any, n: int) -> bytes:
    """The first ``n`` bytes of the file whose descriptor was passed to the worker (a ``PassedFd``)."""
    return os.pread(passed.fd, n, 0)


class Unsendable(Exception):
    """An exception that cannot be pickled (it holds a lock)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def raise_unpicklable(task: int) -> int:
    raise Unsendable("cannot travel")


class FailsToStart:
    """A worker function whose ``start()`` raises."""

    def start(self) -> None:
        raise ValueError("cannot start")

    def __call__(self, task: int) -> int:
        return task


def produce_dies_once(task: tuple[int, int, str]) -> tuple[np.ndarray, np.ndarray]:
    """Task ``(seed, n, marks)``: :func:`produce` of ``(seed, n)``, except that task seed 3, the first time it
    runs, leaves ``died-3`` in the directory ``marks`` and kills its own worker process with SIGKILL (as the
    OOM killer would).  An engine that retries the task gets the normal result the second time."""
    seed, n, marks = task
    mark = Path(marks, f"died-{seed}")
    if seed == 3 and not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return task_data((seed, n))


def produce_kills_at_4(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`produce`, except that the worker running task seed 4 kills itself with SIGKILL, every time."""
    if task[0] == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return task_data(task)


def produce_tagged(task: tuple[int, int, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Task ``(seed, n, tag)``: :func:`produce` of ``(seed, n)``; the tag (a set, an array...) only tells tasks
    apart."""
    return task_data(task[:2])


def set_tasks(n_tasks: int) -> list[tuple[int, int, frozenset[str]]]:
    """Tasks that hold a frozenset of strings: their repr changes with the hash seed."""
    return [(i, 5, frozenset(f"tag-{i}-{k}" for k in range(8))) for i in range(n_tasks)]


class Job:
    """A task of a user's own class: picklable, with the default repr (which names a memory address)."""

    def __init__(self, seed: int, n: int) -> None:
        self.seed, self.n = seed, n


def job_id(job: Job) -> tuple[int, int]:
    return job.seed, job.n


def produce_job(job: Job) -> tuple[np.ndarray, np.ndarray]:
    return task_data((job.seed, job.n))


def name_tasks(n_tasks: int) -> set[str]:
    """A *set* of task names (``"task-<seed>"``): it iterates in hash order, which changes with the hash seed."""
    return {f"task-{i}" for i in range(n_tasks)}


#: A task :func:`produce_named` raises for (a run that stops part way), named in the environment.
FAIL_AT_ENV = "LMDBSTORE_TEST_FAIL_AT"


def produce_named(task: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`produce` of ``(seed, 5)`` for the task ``"task-<seed>"``; raises for the task ``$LMDBSTORE_TEST_FAIL_AT``."""
    if task == os.environ.get(FAIL_AT_ENV):
        raise RuntimeError(f"boom in {task}")
    return task_data((int(task.split("-")[1]), 5))


def main() -> int:
    from lmdbstore import write_parallel

    store, n_tasks, workers, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    tasks: list[Any] = [(i, 50 + i % 7) for i in range(n_tasks)]
    if name == "produce_tagged":
        tasks = set_tasks(n_tasks)
    if name.startswith("produce_named"):
        tasks = name_tasks(n_tasks)  # type: ignore[assignment]
    fn = globals()[name]
    from lmdbstore import WriterConfig

    cfg = WriterConfig(commit_bytes=1, sync=False)  # a commit per task: many chances to be killed
    try:
        report = write_parallel(
            store,
            fn,
            tasks,
            workers=workers,
            shape=SHAPE,
            dtype="float32",
            classes=CLASSES,
            config=cfg,
            progress=False,
        )
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        return 130
    except Exception as exc:  # a task's failure: one line, what a script's user sees
        print(f"failed {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"done {report.added} {report.total} {report.skipped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def produce_huge(task: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Like :func:`produce`, as float64 values near 1e300 (their squares overflow float64)."""
    x, y = task_data(task)
    return x.astype(np.float64) * 1e300, y


def produce_tagged_fails_at_3(task: tuple[int, int, Any]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`produce_tagged`, except that task seed 3 raises."""
    if task[0] == 3:
        raise RuntimeError("boom in task three")
    return produce_tagged(task)
