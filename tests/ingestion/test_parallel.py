"""write_parallel: same store for any worker count, resume after kills and Ctrl-C, errors naming the task,
validation, no orphan processes.  Real spawned workers and real stores throughout (the pool on its own:
test_pool.py)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import parallel_tasks as pt
import pytest
from conftest import TESTS, default_sigint

from lmdbstore import TaskError, ValidationError, WriterConfig, open_reader, open_writer, write_parallel
from lmdbstore.format.layout import DB_PROGRESS
from lmdbstore.tools.verify import verify_store

SCRIPT = TESTS / "parallel_tasks.py"
SMALL = WriterConfig(commit_bytes=4096, sync=False)  # several commits per run


def _tasks(n: int) -> list[tuple[int, int]]:
    return [(i, 50 + i % 7) for i in range(n)]  # the tasks parallel_tasks.main() runs


def _write(path: Path, produce=pt.produce, tasks=None, **kw):  # type: ignore[no-untyped-def]
    """``write_parallel`` of ``parallel_tasks``' shape and classes; 2 workers, float32 and SMALL unless given."""
    kw = {"workers": 2, "dtype": "float32", "config": SMALL, **kw}
    return write_parallel(
        path,
        produce,
        _tasks(12) if tasks is None else tasks,
        shape=pt.SHAPE,
        classes=pt.CLASSES,
        progress=False,
        **kw,
    )


def _content(path: Path) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    with open_reader(path) as r:
        return r.read_range(0, len(r)), r.labels().astype(np.int64), [r.class_indices(c) for c in range(3)]


def _assert_holds(path: Path, tasks: list[tuple[int, int]]) -> None:
    x, y, _ = _content(path)
    if not tasks:
        assert len(x) == 0
        return
    want_x, want_y = pt.expected(tasks)
    assert len(x) == len(want_x)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(y, want_y)


def test_same_store_for_any_worker_count(tmp_path: Path) -> None:
    tasks = _tasks(20)
    contents = {}
    for workers in (0, 1, 2, 4):
        report = _write(tmp_path / f"w{workers}", tasks=tasks, workers=workers)
        assert (report.tasks, report.skipped, report.added) == (20, 0, len(pt.expected(tasks)[1]))
        contents[workers] = _content(tmp_path / f"w{workers}")
        assert verify_store(tmp_path / f"w{workers}").ok
    _assert_holds(tmp_path / "w1", tasks)
    for workers in (0, 2, 4):
        x, y, idx = contents[workers]
        np.testing.assert_array_equal(x, contents[1][0])
        np.testing.assert_array_equal(y, contents[1][1])
        for a, b in zip(idx, contents[1][2], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_producer_reusing_its_output_buffer_in_this_process_is_copied_before_the_next_task(tmp_path: Path) -> None:
    # workers=0 runs produce here: its result is its own array, which the writer must copy (not keep until the
    # commit, as it keeps the results unpickled from worker processes)
    tasks = _tasks(9)
    for workers in (0, 2):
        path = tmp_path / f"w{workers}"
        _write(path, produce=pt.produce_into_one_buffer, tasks=tasks, workers=workers, config=WriterConfig(sync=False))
        _assert_holds(path, tasks)


def test_generator_producer_with_class_names_gives_the_same_store(tmp_path: Path) -> None:
    _write(tmp_path / "chunks", produce=pt.produce_chunks)
    _assert_holds(tmp_path / "chunks", _tasks(12))


def test_rerun_skips_finished_tasks_and_a_longer_list_writes_only_its_new_tasks(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _write(path, tasks=_tasks(6))
    again = _write(path, tasks=_tasks(6))
    assert (again.skipped, again.added) == (6, 0)
    more = [(100 + i, 9) for i in range(3)]
    grown = _write(path, tasks=_tasks(6) + more)  # the same run's list, grown
    assert (grown.skipped, grown.tasks) == (6, 9)
    _assert_holds(path, _tasks(6) + more)
    with pytest.raises(ValueError, match=r"finished run 'parallel_tasks\.produce' of other tasks"):
        _write(path, tasks=more)  # other tasks under the same name: never mixed in
    _write(path, tasks=more, name="second batch")  # a separate run, said so
    _assert_holds(path, _tasks(6) + more + more)


def test_raising_task_stops_the_run_naming_it_and_keeps_earlier_tasks(tmp_path: Path) -> None:
    path = tmp_path / "s"
    tasks = _tasks(10)
    with pytest.raises(TaskError, match=r"task #5 \(\(5, 55\)\) raised RuntimeError: boom in task five") as err:
        _write(path, produce=pt.produce_fails_at_5, tasks=tasks, name="job")
    assert err.value.key == 5 and "boom in task five" in (err.value.remote_traceback or "")
    _assert_holds(path, tasks[:5])
    # the same run, fixed, resumes at task 5 and ends with every task exactly once
    report = _write(path, tasks=tasks, name="job")
    assert report.skipped == 5
    _assert_holds(path, tasks)
    assert verify_store(path).ok


def test_an_unfinished_run_of_other_tasks_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with pytest.raises(TaskError):
        _write(path, produce=pt.produce_fails_at_5, tasks=_tasks(10), name="job")
    with pytest.raises(ValueError, match="unfinished run 'job'"):
        _write(path, tasks=_tasks(11), name="job")
    _assert_holds(path, _tasks(5))


@pytest.mark.parametrize(
    ("kind", "error", "words"),
    [
        ("nan", ValidationError, "non-finite value"),
        ("shape", ValidationError, "shape (8, 3, 4)"),
        ("dtype", ValidationError, "dtype float64"),
        ("label", ValidationError, "label 7 out of range"),
        ("none", TaskError, "must return (x, y)"),
    ],
)
def test_bad_results_are_refused_naming_the_task(tmp_path: Path, kind: str, error: type, words: str) -> None:
    path = tmp_path / "s"
    tasks = [("ok", 0), ("ok", 1), (kind, 2), ("ok", 3)]
    with pytest.raises(error, match=r"task #2 \(\('" + kind) as err:
        _write(path, produce=pt.produce_bad, tasks=tasks)
    assert words in str(err.value)
    _assert_holds(path, [(0, 8), (1, 8)])


def test_cast_accepts_float64(tmp_path: Path) -> None:
    _write(tmp_path / "s", produce=pt.produce_bad, tasks=[("dtype", 0), ("ok", 1)], cast=True)
    _assert_holds(tmp_path / "s", [(0, 8), (1, 8)])


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="module-level function"):
        _write(tmp_path / "s", produce=lambda t: pt.task_data(t))
    with pytest.raises(ValueError, match="workers must be >= 0"):
        _write(tmp_path / "s", workers=-1)
    with pytest.raises(ValueError, match="in_flight must be positive"):
        _write(tmp_path / "s", in_flight=0)
    with pytest.raises(ValueError, match=r"tasks\[0\] \(type object\) has no stable identity"):
        _write(tmp_path / "s", tasks=[object()])
    with pytest.raises(ValueError, match=r"tasks\[1\] cannot be sent to a worker process"):
        _write(tmp_path / "s", tasks=[(0, 5), pt.Unpicklable()], task_id=repr)


def test_a_dying_worker_stops_the_run(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with pytest.raises(TaskError, match="worker process died"):
        _write(path, produce=os._exit, tasks=[3])
    with open_reader(path) as r:
        assert len(r) == 0


def _started(pid_dir: Path) -> set[int]:
    return {int(p.name) for p in pid_dir.iterdir() if p.name.isdigit()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: set[int], seconds: float = 10.0) -> set[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = {p for p in pids if _alive(p)}
        if not left:
            return left
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


def _start(
    store: Path, n_tasks: int, workers: int, pid_dir: Path, producer: str = "produce_slow"
) -> subprocess.Popen[str]:
    env = {**os.environ, pt.PID_DIR_ENV: str(pid_dir)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(store), str(n_tasks), str(workers), producer],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,  # a terminal's Ctrl-C, also when pytest runs in the background
    )


def _tasks_done(path: Path) -> int:
    """Tasks the store's ledger says are committed (the one write_parallel run of parallel_tasks.main)."""
    with open_reader(path) as r:
        entries = [json.loads(bytes(v)) for k, v in r.iter_raw(DB_PROGRESS) if k.startswith(b"parallel:")]
    assert len(entries) <= 1
    return entries[0]["done"] if entries else 0


@pytest.mark.slow
def test_killed_at_random_moments_then_rerun_gives_exact_content(tmp_path: Path) -> None:
    store, pid_dir = tmp_path / "s", tmp_path / "pids"
    pid_dir.mkdir()
    tasks = _tasks(100)
    rng = random.Random(13)
    done = []
    for _ in range(4):
        proc = _start(store, len(tasks), 2, pid_dir)
        deadline = time.monotonic() + 60
        while not list(pid_dir.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # until a worker runs a task (or the run is over: every task done)
        time.sleep(rng.uniform(0.0, 1.0))  # tasks commit every ~20 ms
        with contextlib.suppress(ProcessLookupError):  # the run may have ended (every task done) meanwhile
            os.killpg(proc.pid, signal.SIGKILL)  # the parent and its workers, mid-run
        proc.wait(10)
        for p in pid_dir.iterdir():
            p.unlink()
        if store.exists():  # after every kill: exactly the tasks the ledger counts, in order
            done.append(_tasks_done(store))
            _assert_holds(store, tasks[: done[-1]])
    proc = _start(store, len(tasks), 2, pid_dir)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    _assert_holds(store, tasks)
    assert verify_store(store).ok
    assert any(0 < d < len(tasks) for d in done), done  # some kill hit mid-run


def _start_gated(store: Path, n_tasks: int, pid_dir: Path) -> subprocess.Popen[str]:
    """Start a 2-worker run of :func:`parallel_tasks.produce_gated` and return once both workers run a task
    and one waits at the gate (the tasks before it are produced; the run cannot end until ``go`` exists)."""
    proc = _start(store, n_tasks, 2, pid_dir, "produce_gated")
    deadline = time.monotonic() + 60
    while (len(_started(pid_dir)) < 2 or not (pid_dir / "waiting").exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    return proc


@pytest.mark.slow
def test_ctrl_c_stops_workers_cleanly_and_rerun_completes(tmp_path: Path) -> None:
    store, pid_dir = tmp_path / "s", tmp_path / "pids"
    pid_dir.mkdir()
    proc = _start_gated(store, 200, pid_dir)
    time.sleep(1.0)  # the parent commits the tasks before the gate
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    workers = _started(pid_dir)
    assert len(workers) == 2
    assert not _wait_gone(workers, 1.0)  # stopped by the parent, not left running
    with open_reader(store) as r:
        assert 0 < len(r) < len(pt.expected(_tasks(200))[1])
    (pid_dir / "go").touch()
    proc = _start(store, 200, 2, pid_dir, "produce_gated")
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    _assert_holds(store, _tasks(200))


@pytest.mark.slow
def test_workers_of_a_killed_parent_die_with_it(tmp_path: Path) -> None:
    store, pid_dir = tmp_path / "s", tmp_path / "pids"
    pid_dir.mkdir()
    proc = _start_gated(store, 200, pid_dir)
    os.kill(proc.pid, signal.SIGKILL)  # only the parent, while a worker waits inside a task (at the gate)
    proc.wait(10)
    workers = _started(pid_dir)
    assert len(workers) == 2
    assert not _wait_gone(workers, 10.0)  # gone with it (their lifeline), not after finishing the task


def test_value_statistics_from_the_workers_match_the_writers_own(tmp_path: Path) -> None:
    tasks = _tasks(9)
    x, y = pt.expected(tasks)
    x[5, 1, 1] = np.inf  # counted, not folded into the moments
    cfg = WriterConfig(commit_bytes=4096, sync=False, allow_nonfinite=True)
    with open_writer(tmp_path / "plain", shape=pt.SHAPE, dtype="float32", classes=pt.CLASSES, config=cfg) as w:
        w.append(x, y)
    _write(tmp_path / "par", pt.produce_with_inf, tasks, config=cfg)
    with open_reader(tmp_path / "plain") as a, open_reader(tmp_path / "par") as b:
        sa, sb = a.meta.value_stats, b.meta.value_stats
    assert (
        (sb.n, sb.nonfinite, sb.min, sb.max) == (sa.n, sa.nonfinite, sa.min, sa.max) == (x.size - 1, 1, sa.min, sa.max)
    )
    assert sb.sum == pytest.approx(sa.sum, rel=1e-9) and sb.sumsq == pytest.approx(sa.sumsq, rel=1e-9)


def test_statistics_of_huge_values_from_workers_stay_finite(tmp_path: Path) -> None:
    tasks = [(i, 40) for i in range(3)]
    x, _ = pt.expected(tasks)
    report = _write(tmp_path / "s", pt.produce_huge, tasks, workers=1, dtype="float64")
    assert report.total == len(x)
    with open_reader(tmp_path / "s") as r:
        stats = r.meta.value_stats
    f = x.astype(np.float64)  # the data divided by 1e300
    assert stats.n == f.size
    assert stats.mean == pytest.approx(f.mean() * 1e300, rel=1e-9)
    assert stats.std == pytest.approx(f.std() * 1e300, rel=1e-9)


def test_workers_and_results_in_flight_are_bounded_by_the_machine(tmp_path: Path) -> None:
    """``workers=100000`` started that many processes, ``in_flight=10**9`` let every result pile up (issue 34,
    memory): the local pool starts at most 4 per core and what memory holds (a warning names ``workers``), and
    holds as many results as half the available memory takes at the largest seen (a warning names ``in_flight``);
    the store is the same."""
    from lmdbstore.util.memory import MemoryBoundWarning
    from lmdbstore.util.procs import WORKER_BYTES
    from lmdbstore.util.procs import worker_processes as local_workers

    gib = 1 << 30
    assert local_workers(3, cores=2, available=64 * gib) == 3
    with pytest.warns(MemoryBoundWarning, match="workers: 100,000 worker processes on 2 cores .* using 8"):
        assert local_workers(100_000, cores=2, available=64 * gib) == 8
    with pytest.warns(MemoryBoundWarning, match="workers: 8 worker processes"):
        assert local_workers(8, cores=2, available=4 * WORKER_BYTES) == 2
    tasks = _tasks(6)
    with pytest.warns(MemoryBoundWarning, match="workers: 100,000"):
        report = _write(tmp_path / "s", tasks=tasks, workers=100_000, in_flight=10**9)
    assert report.added == len(pt.expected(tasks)[1])
    _assert_holds(tmp_path / "s", tasks)
