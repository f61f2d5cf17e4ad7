"""The ordered pool (lmdbstore.util.pool) on its own: results in task order, back-pressure, a raising task and a
killed worker reported as such, and no child process left behind however the results end.  Real spawned worker
processes throughout."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import parallel_tasks as pt
import pytest

from lmdbstore.util.pool import OrderedPool, TaskFailure
from lmdbstore.util.workers import WorkerDied


def _children() -> set[int]:
    """Ids of this process's child processes, zombies (exited, not yet reaped) included."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rpartition(")")[2].split()[1]) == me:  # fields after "(comm)": state, ppid, ...
            out.add(int(entry.name))
    return out


@pytest.mark.parametrize("workers", [0, 3])
def test_results_come_in_task_order(workers: int) -> None:
    # earlier tasks take longest, so workers finish them last: the pool still yields them first
    tasks = [(i, 0.02 * (8 - i)) for i in range(8)]
    pool = OrderedPool(pt.square_after, workers=workers, limit=6)
    assert list(pool.results(tasks)) == [(i, i * i) for i in range(8)]
    assert list(pool.results(tasks, start=5)) == [(5, 25), (6, 36), (7, 49)]
    assert list(pool.results(tasks, start=8)) == []


def test_back_pressure_bounds_the_tasks_ahead_of_the_consumer(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(pt.PID_DIR_ENV, str(marks))
    pool = OrderedPool(pt.mark_task, workers=2, limit=3)
    tasks = [(str(marks), i) for i in range(12)]
    seen = []
    for index, out in pool.results(tasks):
        time.sleep(0.15)  # a slow consumer: workers would run ahead without back-pressure
        started = [int(p.name.split("-")[1]) for p in marks.glob("task-*")]
        assert max(started) <= index + 3, (index, sorted(started))
        seen.append((index, out))
    assert seen == [(i, i * 2) for i in range(12)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_raising_task_is_a_task_failure_with_its_index(workers: int) -> None:
    got = []
    with pytest.raises(TaskFailure) as err:
        for index, out in OrderedPool(pt.raise_at_3, workers=workers, limit=4).results(list(range(8))):
            got.append((index, out))
    assert got == [(0, 0), (1, 1), (2, 2)]  # everything before the failing task, nothing after
    failure = err.value
    assert failure.index == 3 and failure.type_name == "ValueError" and failure.message == "task three is bad"
    assert "raise_at_3" in failure.tb and "ValueError: task three is bad" in failure.tb


def test_a_killed_worker_is_worker_died() -> None:
    pool = OrderedPool(pt.kill_self_at_4, workers=2, limit=4)
    got = []
    with pytest.raises(WorkerDied) as err:
        for index, out in pool.results(list(range(8))):
            got.append((index, out))
    assert err.value.exitcode == -9  # killed by SIGKILL
    assert got == [(i, i) for i in range(len(got))] and 1 <= len(got) <= 4  # task 4 went out after task 0
    assert not mp.active_children()


def _to_the_end(results: Iterator[tuple[int, Any]]) -> None:
    """Consume every result; a failing task or a dead worker ends the results with its exception."""
    with contextlib.suppress(TaskFailure, WorkerDied):
        for _ in results:
            pass


@pytest.mark.parametrize(
    ("fn", "end"),
    [
        (pt.worker_pid, _to_the_end),
        (pt.worker_pid, lambda results: results.close()),  # the consumer stops early
        (pt.raise_at_3, _to_the_end),
        (pt.kill_self_at_4, _to_the_end),  # the other worker must go too
    ],
    ids=["complete", "closed-early", "task-failed", "worker-killed"],
)
def test_no_worker_outlives_the_results(fn: Callable[[int], int], end: Callable[[Any], None]) -> None:
    resource_tracker.ensure_running()  # spawn's helper process, started once and kept: not a worker
    before = _children()
    results = OrderedPool(fn, workers=2, limit=4).results(list(range(12)))
    assert next(results)[0] == 0  # every worker has been started by now
    workers = _children() - before
    assert len(workers) == 2
    end(results)
    assert not mp.active_children()
    assert not workers & _children(), "a worker is still running or was not reaped"


_FAIL_AND_EXIT = """
import sys
sys.path.insert(0, sys.argv[1])
import parallel_tasks as pt
from lmdbstore.util.pool import OrderedPool, TaskFailure
if __name__ == "__main__":
    try:
        for _ in OrderedPool(pt.raise_at_3, 2, 8).results(list(range(40))):
            pass
    except TaskFailure as exc:
        print(exc.index)
"""


def test_a_failed_run_leaves_nothing_for_the_resource_tracker(tmp_path: Path) -> None:
    # multiprocessing's resource tracker warns at exit about semaphores a run left behind ("leaked semaphore
    # objects"); the pool shares none with its workers, so a failing run exits with a clean stderr.
    import subprocess
    import sys

    from conftest import TESTS

    script = tmp_path / "fail.py"
    script.write_text(_FAIL_AND_EXIT)
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(script), str(TESTS)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "3", proc.stderr
        assert proc.stderr == ""
