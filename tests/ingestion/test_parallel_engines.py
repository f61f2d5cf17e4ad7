"""write_parallel on engines people already run: a ProcessPoolExecutor, a Dask LocalCluster with 2 worker
processes (through its Client and its executor), Ray when installed.  The same store bytes (samples, labels,
class index, ledger) as the local pool; a raising task, a bad result and a task lost with its worker named; a
worker killed mid-run retried by the engine; a rerun resuming exactly; the window of tasks in flight bounded.
Real engines and real stores throughout; EnginePool on its own at the end."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import parallel_tasks as pt
import pytest
from conftest import REPO, TESTS, snapshot_store

from lmdbstore import TaskError, ValidationError, WriterConfig, open_reader, open_writer, write_parallel
from lmdbstore.format.layout import DB_META
from lmdbstore.ingestion.engines import DaskEngine, EnginePool, FuturesEngine, TaskLost, engine_of
from lmdbstore.tools.verify import verify_store
from lmdbstore.util.pool import TaskFailure

SMALL = WriterConfig(commit_bytes=4096, sync=False)  # several commits per run
TASKS = [(i, 50 + i % 7) for i in range(14)]


def _write(path: Path, tasks: list[Any] = TASKS, produce: Any = pt.produce, **kw: Any) -> Any:
    return write_parallel(
        path,
        produce,
        tasks,
        shape=pt.SHAPE,
        dtype="float32",
        classes=pt.CLASSES,
        progress=False,
        **{"config": SMALL, **kw},
    )


def _store_bytes(path: Path) -> dict[bytes, Any]:
    """Every key and value of every sub-database, the metadata without its timestamps and its store id (a
    random id of each store, drawn at creation)."""
    snap: dict[bytes, Any] = dict(snapshot_store(path))
    meta = {k: json.loads(v) for k, v in snap.pop(DB_META).items()}
    for m in meta.values():
        m.pop("created_at"), m.pop("updated_at"), m.pop("store_id")
    snap[DB_META] = meta
    return snap


def _assert_holds(path: Path, tasks: list[tuple[int, int]]) -> None:
    if not tasks:
        with open_reader(path) as r:
            assert len(r) == 0
        return
    want_x, want_y = pt.expected(tasks)
    with open_reader(path) as r:
        np.testing.assert_array_equal(r.read_range(0, len(r)), want_x)
        np.testing.assert_array_equal(r.labels(), want_y)


@pytest.fixture(scope="module")
def local_bytes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[bytes, Any]]:
    """The store bytes of TASKS written by 1 and by 2 local workers."""
    base = tmp_path_factory.mktemp("local")
    out = {}
    for workers in (1, 2):
        _write(base / f"w{workers}", workers=workers)
        out[workers] = _store_bytes(base / f"w{workers}")
    assert out[1] == out[2]
    return out


def _spawn_pool(n: int = 2) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"))


# ---------------------------------------------------------------------------------------- ProcessPoolExecutor
def test_process_pool_executor_writes_the_same_store_bytes(tmp_path: Path, local_bytes: dict[int, Any]) -> None:
    with _spawn_pool() as ex:
        report = _write(tmp_path / "s", executor=ex)
        assert (report.tasks, report.skipped, report.added) == (len(TASKS), 0, len(pt.expected(TASKS)[1]))
        assert _store_bytes(tmp_path / "s") == local_bytes[1]
        again = _write(tmp_path / "s", executor=ex)  # every task is in the ledger: nothing to do
        assert (again.skipped, again.added) == (len(TASKS), 0)


def test_fork_pool_workers_never_hold_the_store(tmp_path: Path) -> None:
    # a fork-based pool starts its workers at its first task; started after the writer opened, they would
    # inherit the writer's lock and keep the store locked for as long as they live
    with ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as ex:
        _write(tmp_path / "s", executor=ex)
        with open_writer(tmp_path / "s") as w:  # not StoreLockedError: the lock went with the writer
            assert w.count == len(pt.expected(TASKS)[1])


def test_process_pool_raising_task_is_named_and_the_run_resumes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with _spawn_pool() as ex:
        with pytest.raises(TaskError, match=r"task #5 \(\(5, 55\)\) raised RuntimeError: boom in task five") as err:
            _write(path, produce=pt.produce_fails_at_5, executor=ex, name="job")
        assert err.value.key == 5 and "boom in task five" in (err.value.remote_traceback or "")
        _assert_holds(path, TASKS[:5])
        assert _write(path, executor=ex, name="job").skipped == 5
    _assert_holds(path, TASKS)


def test_process_pool_worker_killed_is_named_and_a_rerun_resumes_exactly(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    tasks = [(*t, str(marks)) for t in TASKS]
    path = tmp_path / "s"
    with _spawn_pool() as ex, pytest.raises(TaskError, match=r"task #\d+ .* was lost with its worker: Broken") as err:
        _write(path, tasks=tasks, produce=pt.produce_dies_once, executor=ex)
    assert "rerun" in str(err.value) and err.value.key <= 3  # lost at task 3 at the latest (the pool breaks)
    _assert_holds(path, TASKS[: err.value.key])
    with _spawn_pool() as ex:  # a broken pool stays broken: a new one resumes the run
        assert _write(path, tasks=tasks, produce=pt.produce_dies_once, executor=ex).skipped == err.value.key
    _assert_holds(path, TASKS)
    assert verify_store(path).ok


def test_a_thread_pool_producer_reusing_its_output_buffer_is_copied_before_the_next_task(tmp_path: Path) -> None:
    # a thread pool hands over produce's own array (nothing unpickled): the writer copies it, while a process
    # pool's results are copies made for it, kept as they are until the commit
    assert not FuturesEngine(ThreadPoolExecutor(1)).private_results
    with _spawn_pool(1) as ex:
        assert FuturesEngine(ex).private_results
    with ThreadPoolExecutor(1) as ex:
        _write(tmp_path / "s", produce=pt.produce_into_one_buffer, executor=ex, in_flight=1, config=WriterConfig())
    _assert_holds(tmp_path / "s", TASKS)


def test_bad_executor_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give a number of worker processes"):
        write_parallel(tmp_path / "s", pt.produce, TASKS, shape=pt.SHAPE, dtype="float32", classes=pt.CLASSES)
    with pytest.raises(ValueError, match=r"executor must be a concurrent\.futures\.Executor"):
        _write(tmp_path / "s", executor=object())
    with ThreadPoolExecutor(1) as ex:
        with pytest.raises(ValueError, match="workers must be positive with an executor"):
            _write(tmp_path / "s", executor=ex, workers=0)
        with pytest.raises(ValueError, match="module-level function"):
            _write(tmp_path / "s", executor=ex, produce=lambda t: pt.task_data(t))
    with pytest.raises(ValueError, match=r"executor cannot run a task \(RuntimeError: cannot schedule"):
        _write(tmp_path / "s", executor=ex)  # shut down
    assert not (tmp_path / "s").exists()  # nothing was created


# ---------------------------------------------------------------------------------------- Dask
@pytest.fixture(scope="module")
def distributed() -> Any:
    """Dask's ``distributed`` (in the ``[dev]`` extra); the Dask tests skip without it."""
    return pytest.importorskip("distributed", reason="Dask's distributed is not installed")


@pytest.fixture(scope="module")
def dask_client(distributed: Any) -> Iterator[Any]:
    """A LocalCluster of 2 worker processes (one thread each), shared by the Dask tests that kill nothing
    for good (a worker a test kills is restarted by its nanny)."""
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as c,
        distributed.Client(c) as client,
    ):
        yield client


def test_dask_client_and_its_executor_write_the_same_store_bytes(
    tmp_path: Path, dask_client: Any, local_bytes: dict[int, Any]
) -> None:
    assert isinstance(engine_of(dask_client), DaskEngine) and engine_of(dask_client).workers() == 2
    assert engine_of(dask_client).private_results  # gathered over tcp://: unpickled here
    assert isinstance(engine_of(dask_client.get_executor()), FuturesEngine)
    for kind, executor in (("client", dask_client), ("executor", dask_client.get_executor())):
        report = _write(tmp_path / kind, executor=executor)
        assert report.added == len(pt.expected(TASKS)[1])
        assert _store_bytes(tmp_path / kind) == local_bytes[1] == local_bytes[2], kind


def test_dask_in_this_process_hands_over_produce_s_own_arrays_and_the_writer_copies_them(
    tmp_path: Path, distributed: Any
) -> None:
    # a cluster inside this process (inproc://) passes results without pickling them: a producer refilling one
    # array must not see its earlier tasks rewritten
    with (
        distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as c,
        distributed.Client(c) as client,
    ):
        assert not engine_of(client).private_results
        _write(tmp_path / "s", produce=pt.produce_into_one_buffer, executor=client, in_flight=1, config=WriterConfig())
    _assert_holds(tmp_path / "s", TASKS)


def test_dask_raising_task_and_bad_result_are_named(tmp_path: Path, dask_client: Any) -> None:
    path = tmp_path / "s"
    with pytest.raises(TaskError, match=r"task #5 \(\(5, 55\)\) raised RuntimeError: boom in task five") as err:
        _write(path, produce=pt.produce_fails_at_5, executor=dask_client, name="job")
    assert "parallel_tasks.py" in (err.value.remote_traceback or "")  # the worker's frames
    _assert_holds(path, TASKS[:5])
    assert _write(path, executor=dask_client, name="job").skipped == 5  # the same run, resumed on Dask
    _assert_holds(path, TASKS)
    bad = [("ok", 0), ("ok", 1), ("nan", 2), ("ok", 3)]
    with pytest.raises(ValidationError, match=r"task #2 \(\('nan', 2\)\): non-finite value"):
        _write(tmp_path / "bad", tasks=bad, produce=pt.produce_bad, executor=dask_client)
    _assert_holds(tmp_path / "bad", [(0, 8), (1, 8)])


def test_dask_retries_a_task_whose_worker_was_killed(tmp_path: Path, dask_client: Any) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    tasks = [(*t, str(marks)) for t in TASKS]
    _write(tmp_path / "s", tasks=tasks, produce=pt.produce_dies_once, executor=dask_client)
    assert (marks / "died-3").exists()  # a worker did die, mid-run
    _assert_holds(tmp_path / "s", TASKS)  # and the run completed exactly
    assert verify_store(tmp_path / "s").ok


def test_dask_task_lost_for_good_is_named_and_a_rerun_resumes(tmp_path: Path, distributed: Any) -> None:
    import dask

    path = tmp_path / "s"
    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 0}),  # no retry: the first loss is final
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as c,
        distributed.Client(c) as client,
    ):
        with pytest.raises(TaskError, match=r"task #\d \(\(\d, 5\d\)\) was lost with its worker: KilledWorker") as err:
            _write(path, produce=pt.produce_kills_at_4, executor=client, name="job")
        # task 4 kills its worker; tasks waiting on that worker (or done there and not yet gathered) die with it:
        # the first of them in task order is named, and every task before it is committed
        lost = err.value.key
        assert 0 <= lost <= 4 and f"task #{lost} (({lost}, {50 + lost}))" in str(err.value)
        _assert_holds(path, TASKS[:lost])
        assert _write(path, executor=client, name="job").skipped == lost
    _assert_holds(path, TASKS)


# ---------------------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_executor() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lmdbstore[ray]')")
    from lmdbstore.ingestion.ray_executor import RayExecutor

    # Ray's workers are not children of this process: they find the tests' producers on PYTHONPATH
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{TESTS}:{REPO}"}},
    )
    try:
        yield RayExecutor()
    finally:
        ray.shutdown()


def test_ray_writes_the_same_store_bytes_and_names_a_raising_task(
    tmp_path: Path, ray_executor: Any, local_bytes: dict[int, Any]
) -> None:
    assert ray_executor.workers == 2
    _write(tmp_path / "s", executor=ray_executor)
    assert _store_bytes(tmp_path / "s") == local_bytes[1]
    with pytest.raises(TaskError, match=r"task #5 \(\(5, 55\)\) raised RuntimeError: boom in task five"):
        _write(tmp_path / "f", produce=pt.produce_fails_at_5, executor=ray_executor)
    _assert_holds(tmp_path / "f", TASKS[:5])


def test_ray_retries_a_task_whose_worker_was_killed(tmp_path: Path, ray_executor: Any) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    _write(tmp_path / "s", tasks=[(*t, str(marks)) for t in TASKS], produce=pt.produce_dies_once, executor=ray_executor)
    assert (marks / "died-3").exists()
    _assert_holds(tmp_path / "s", TASKS)


# ---------------------------------------------------------------------------------------- EnginePool alone
def test_engine_pool_keeps_a_bounded_window_in_task_order(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    tasks = [(str(marks), i) for i in range(12)]
    with ThreadPoolExecutor(4) as ex:
        pool = EnginePool(pt.mark_task, FuturesEngine(ex), in_flight=1, workers=3)
        seen = []
        for index, out in pool.results(tasks):
            time.sleep(0.05)  # a slow consumer: the engine would run ahead without the window
            started = [int(p.name.split("-")[1]) for p in marks.glob("task-*")]
            assert max(started) < index + 3, (index, sorted(started))
            seen.append((index, out))
    assert seen == [(i, 2 * i) for i in range(12)]


def test_engine_pool_reports_failures_and_cancels_the_window(tmp_path: Path) -> None:
    with ThreadPoolExecutor(1) as ex:
        got = []
        with pytest.raises(TaskFailure) as err:
            for index, out in EnginePool(pt.raise_at_3, FuturesEngine(ex), in_flight=1, workers=1).results(range(8)):
                got.append((index, out))
        assert got == [(0, 0), (1, 1), (2, 2)] and err.value.index == 3 and err.value.type_name == "ValueError"
        assert "raise_at_3" in err.value.tb
        marks = tmp_path / "marks"
        marks.mkdir()
        results = EnginePool(pt.mark_task, FuturesEngine(ex), in_flight=4, workers=1).results(
            [(str(marks), i) for i in range(40)]
        )
        assert next(results) == (0, 0)
        results.close()  # the tasks still in the window are cancelled
    assert len(list(marks.glob("task-*"))) <= 5
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        with pytest.raises(TaskLost, match="BrokenProcessPool") as lost:
            list(EnginePool(pt.kill_self_at_4, FuturesEngine(ex), in_flight=2).results(range(8)))
        assert lost.value.index <= 4
