"""Which run a write_parallel call continues (lmdbstore/ingestion/parallel_runs.py): the scenarios of issue 25
with real stores -- tasks holding long numpy arrays that differ in the middle, tasks holding sets under other
hash seeds (separate processes), runs recorded by the previous key scheme, grown and shrunk task lists, tasks
of a user's own class with ``task_id`` -- resumed exactly when they are the same run, refused in one line
when they are not, and never mixed into one store."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import parallel_tasks as pt
import pytest
from conftest import TESTS, raw_env

from lmdbstore import TaskError, WriterConfig, open_reader, write_parallel
from lmdbstore.format.layout import DB_PROGRESS
from lmdbstore.ingestion.task_identity import task_list

SMALL = WriterConfig(commit_bytes=4096, sync=False)


def _write(path: Path, tasks: list[Any], produce: Any = pt.produce, **kw: Any) -> Any:
    """``write_parallel`` in this process (``workers=0``: which run it is does not depend on the workers)."""
    kw = {"workers": 0, "config": SMALL, **kw}
    return write_parallel(
        path, produce, tasks, shape=pt.SHAPE, dtype="float32", classes=pt.CLASSES, progress=False, **kw
    )


def _tasks(n: int) -> list[tuple[int, int]]:
    return [(i, 5 + i % 3) for i in range(n)]


def _holds(path: Path, tasks: list[Any]) -> None:
    """The store holds exactly the samples of ``tasks`` (by seed and size), in order, each once."""
    want_x, want_y = pt.expected([(t[0], t[1]) for t in tasks])
    with open_reader(path) as r:
        np.testing.assert_array_equal(r.read_range(0, len(r)), want_x)
        np.testing.assert_array_equal(r.labels(), want_y)


def _ledger(path: Path) -> dict[str, dict[str, Any]]:
    with raw_env(path, readonly=True) as env, env.begin() as txn:
        db = env.open_db(DB_PROGRESS, txn=txn, create=False)
        return {bytes(k).decode(): json.loads(bytes(v)) for k, v in txn.cursor(db=db)}


def _to_legacy_key(path: Path, tasks: list[Any]) -> str:
    """Rewrite the store's one write_parallel entry as the previous scheme wrote it:
    ``parallel:<name>:<16 hex digits of the sha-256 of the tasks' reprs>``."""
    h = hashlib.sha256()
    for t in tasks:
        h.update(repr(t).encode("utf-8", "replace") + b"\0")
    with raw_env(path) as env, env.begin(write=True) as txn:
        db = env.open_db(DB_PROGRESS, txn=txn, create=False)
        ((key, value),) = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
        run = key.decode().rsplit(":", 1)[0]
        txn.delete(key, db=db)
        legacy = f"{run}:{h.hexdigest()[:16]}"
        txn.put(legacy.encode(), value, db=db)
    return legacy


def _array_tasks(n: int, changed: bool = False) -> list[tuple[int, int, np.ndarray]]:
    """Tasks holding 5,000-element arrays; ``changed``: each array differs in its middle element, which the
    arrays' reprs do not show."""
    out = []
    for i in range(n):
        a = np.arange(5000) + i
        if changed:
            a[2500] = -1
        out.append((i, 5, a))
    return out


def test_tasks_with_long_arrays_that_differ_in_the_middle_are_another_run(tmp_path: Path) -> None:
    path = tmp_path / "s"
    a, b = _array_tasks(6), _array_tasks(6, changed=True)
    assert repr(a) == repr(b)  # what made the previous scheme take b for a resume of a
    with pytest.raises(TaskError, match="boom in task three"):
        _write(path, a, pt.produce_tagged_fails_at_3, name="arrays")
    with pytest.raises(ValueError, match=r"unfinished run 'arrays' of other tasks \(3 of 6 done\)"):
        _write(path, b, pt.produce_tagged, name="arrays")
    _holds(path, a[:3])
    report = _write(path, a, pt.produce_tagged, name="arrays")
    assert (report.skipped, report.tasks) == (3, 6)
    with pytest.raises(ValueError, match="finished run 'arrays' of other tasks"):
        _write(path, b, pt.produce_tagged, name="arrays")
    _holds(path, a)


def _script(store: Path, n_tasks: int, producer: str, seed: str, rc: int = 0, fail_at: str = "") -> str:
    env = {**os.environ, "PYTHONHASHSEED": seed, pt.FAIL_AT_ENV: fail_at}
    proc = subprocess.run(
        [sys.executable, str(TESTS / "parallel_tasks.py"), str(store), str(n_tasks), "0", producer],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == rc, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_set_of_tasks_is_written_in_the_order_of_their_identities(tmp_path: Path) -> None:
    """A set of tasks iterates in hash order, which changes with each process: the identical script rerun was
    refused as another run, and renaming it wrote the committed tasks twice (issue 34 #7).  Now a set is written
    in the order of its tasks' identities: a stopped run resumes under any hash seed, every task once."""
    order = task_list(pt.name_tasks(20))
    assert order == task_list(frozenset(sorted(pt.name_tasks(20), reverse=True)))  # however it was built
    store = tmp_path / "s"
    out = _script(store, 20, "produce_named", "1", rc=1, fail_at="task-7")
    assert out.startswith("failed TaskError: ") and "boom in task-7" in out and "\n" not in out
    done = order.index("task-7")
    for seed, want in (("2", f"done {5 * (20 - done)} 100 {done}"), ("3", "done 0 100 20")):
        assert _script(store, 20, "produce_named", seed) == want
    _holds(store, [(int(t.split("-")[1]), 5) for t in order])


def test_unordered_collections_of_tasks(tmp_path: Path) -> None:
    """frozensets, mappings and dict views are ordered by identity as sets are (the same store as the sorted
    list); two tasks of one identity in an unordered collection are refused before the store exists."""
    tasks = {(i, 5) for i in range(6)}
    order = task_list(tasks)
    for i, given in enumerate((frozenset(tasks), dict.fromkeys(tasks), dict.fromkeys(tasks).keys(),
                               {t: t for t in tasks}.values(), order)):  # fmt: skip
        path = tmp_path / f"s{i}"
        _write(path, given, name="u")  # type: ignore[arg-type]
        _holds(path, order)
        assert _write(path, given, name="u").skipped == 6  # a rerun is the same run: nothing written again
    with pytest.raises(ValueError, match="two tasks with one identity"):
        _write(tmp_path / "dup", {(1, 5), (2, 5)}, task_id=lambda t: t[1])  # type: ignore[arg-type]
    assert not (tmp_path / "dup").exists()


def test_a_finished_run_of_tasks_with_sets_is_not_written_again_under_other_hash_seeds(tmp_path: Path) -> None:
    code = "import parallel_tasks as pt; print(repr(pt.set_tasks(20)))"
    reprs = {}
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=TESTS, env=env
        )
        reprs[seed] = run.stdout
    assert reprs["1"] != reprs["2"]  # the tasks' reprs change with the hash seed
    store = tmp_path / "s"
    assert _script(store, 20, "produce_tagged", "1") == "done 100 100 0"
    assert _script(store, 20, "produce_tagged", "2") == "done 0 100 20"  # was 200: everything again
    assert _script(store, 20, "produce_tagged", "3") == "done 0 100 20"
    _holds(store, pt.set_tasks(20))


def test_a_run_recorded_by_the_previous_scheme_resumes_under_its_key(tmp_path: Path) -> None:
    path, tasks = tmp_path / "s", _tasks(10)
    with pytest.raises(TaskError):
        _write(path, tasks, pt.produce_fails_at_5, name="job")
    legacy = _to_legacy_key(path, tasks)
    report = _write(path, tasks, name="job")
    assert (report.skipped, report.tasks) == (5, 10)
    _holds(path, tasks)
    assert _ledger(path) == {legacy: {"done": 10, "total": 10}}  # finished under the old key
    assert _write(path, tasks, name="job").added == 0  # and a rerun knows it is done
    more = _write(path, [*tasks, (50, 4)], name="job")  # a grown list extends it under the new scheme
    assert (more.skipped, more.added) == (10, 4)
    _holds(path, [*tasks, (50, 4)])


def test_a_run_of_the_previous_scheme_that_reprs_cannot_match_is_refused(tmp_path: Path) -> None:
    path, tasks = tmp_path / "s", _array_tasks(5)
    with pytest.raises(TaskError):
        _write(path, tasks, pt.produce_tagged_fails_at_3, name="job")
    _to_legacy_key(path, tasks)
    with pytest.raises(ValueError, match=r"recorded by an older lmdbstore.* give another name=") as err:
        _write(path, tasks, pt.produce_tagged, name="job")
    assert "\n" not in str(err.value)
    _holds(path, tasks[:3])


def test_an_unfinished_run_of_the_first_tasks_is_finished_before_a_longer_list(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with pytest.raises(TaskError):
        _write(path, _tasks(10), pt.produce_fails_at_5, name="job")
    with pytest.raises(ValueError, match=r"unfinished run 'job' of the first 10 of these tasks \(5 done\)"):
        _write(path, _tasks(12), name="job")
    with pytest.raises(ValueError, match="unfinished run 'job' of other tasks"):
        _write(path, _tasks(8), name="job")  # a shorter list is other tasks too
    assert _write(path, _tasks(10), name="job").skipped == 5
    grown = _write(path, _tasks(12), name="job")
    assert (grown.skipped, grown.tasks) == (10, 12)
    _holds(path, _tasks(12))
    assert _write(path, _tasks(10), name="job").added == 0  # the first run is still finished
    assert _write(path, _tasks(12), name="job").added == 0


def test_a_task_without_identity_is_refused_before_the_store_exists(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with pytest.raises(ValueError, match=r"tasks\[1\] \(type tuple\) has no stable identity .*task_id=") as err:
        _write(path, [(0, 5), (1, 5, {"opts": object()})])
    assert "builtins.object" in str(err.value) and "\n" not in str(err.value)
    assert not path.exists()


def test_task_id_names_tasks_of_a_users_own_class(tmp_path: Path) -> None:
    path = tmp_path / "s"
    jobs = [pt.Job(i, 5) for i in range(4)]
    with pytest.raises(ValueError, match=r"tasks\[0\] \(type Job\) has no stable identity"):
        _write(path, jobs, pt.produce_job)
    with pytest.raises(ValueError, match=r"task_id\(tasks\[0\]\) \(type Job\) has no stable identity"):
        _write(path, jobs, pt.produce_job, task_id=lambda job: job)
    assert not path.exists()
    assert _write(path, jobs, pt.produce_job, task_id=pt.job_id).added == 20
    again = [pt.Job(i, 5) for i in range(4)]  # other objects, the same tasks
    assert _write(path, again, pt.produce_job, task_id=pt.job_id).skipped == 4
    _holds(path, [(i, 5) for i in range(4)])


def test_a_name_that_begins_like_another_run_s_is_another_run(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with pytest.raises(TaskError):
        _write(path, _tasks(10), pt.produce_fails_at_5, name="job:v2")
    assert _write(path, _tasks(3), name="job").skipped == 0  # 'job:v2' is not run 'job'
    _holds(path, _tasks(5) + _tasks(3))
