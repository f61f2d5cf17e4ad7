"""Many producers, one store: :func:`write_parallel` runs ``produce(task)`` in worker processes and commits
their results, in task order, through the single writer of the calling process (LMDB has one writer; generating
samples is CPU-heavy).  Committing in task order lets one resume-ledger entry per run count the tasks in the
store, committed in the same transaction as each task's samples.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import WriterConfig
from lmdbstore.errors import LmdbStoreError, TaskError, ValidationError, clip
from lmdbstore.format.value_stats import ValueStats
from lmdbstore.ingestion.engines import Engine, EnginePool, TaskLost, engine_of
from lmdbstore.ingestion.parallel_runs import plan_run
from lmdbstore.ingestion.reports import ParallelReport, writing
from lmdbstore.ingestion.task_identity import TaskIdentities
from lmdbstore.ingestion.task_identity import task_list as ordered_tasks
from lmdbstore.store.validation import check_samples, label_ids
from lmdbstore.store.writer import StoreWriter
from lmdbstore.util.pool import LOAD_FAILED, OrderedPool, TaskFailure
from lmdbstore.util.procs import worker_processes
from lmdbstore.util.progress import progress_bar
from lmdbstore.util.workers import WorkerDied

__all__ = ["DEFAULT_IN_FLIGHT", "ParallelReport", "TaskResults", "write_parallel"]

#: Results each worker may have produced and not yet had committed (back-pressure bound): while the writer commits
#: (and fsyncs) it takes no result, and the workers go on with the next ones meanwhile.
DEFAULT_IN_FLIGHT = 4
#: Characters of a task's repr quoted in error messages.
REPR_CHARS = 80

Ledger = Callable[[int], tuple[str, int, int | None]]  # task index -> (ledger key, done, total) after it


@dataclass(frozen=True)
class TaskResults:
    """Runs in a worker: ``produce(task)``, validated as ``StoreWriter.append`` does, joined into one ``(x, label
    ids)`` pair (committed atomically with the ledger), with the pair's value statistics."""

    produce: Callable[[Any], Any]
    shape: tuple[int, ...]
    dtype: str
    classes: tuple[str, ...]
    allow_nonfinite: bool = False
    cast: bool = False

    def __call__(self, task: Any) -> tuple[np.ndarray, np.ndarray, ValueStats]:
        x, y = self._joined(self.produce(task))
        stats = ValueStats()
        stats.update(x)  # here, in parallel, rather than in the single writer
        return x, y, stats

    def _joined(self, out: Any) -> tuple[np.ndarray, np.ndarray]:
        xs, ys = [], []
        for x, y in _pairs(out):
            arr = check_samples(
                x, self.shape, np.dtype(self.dtype), allow_nonfinite=self.allow_nonfinite, cast=self.cast
            )
            ids = label_ids(y, len(arr), self.classes)
            xs.append(arr)
            ys.append(ids)
        if len(xs) == 1:
            return xs[0], ys[0]
        if not xs:
            return np.zeros((0, *self.shape), self.dtype), label_ids([], 0, self.classes)
        return np.concatenate(xs), np.concatenate(ys)


def _pairs(out: Any) -> Iterable[tuple[Any, Any]]:
    """``(x, y)`` as one pair, or an iterable of pairs (a generator), as ``produce`` may return."""
    if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[0], tuple):
        return [out]
    if out is None or isinstance(out, (str, bytes, np.ndarray)) or not hasattr(out, "__iter__"):
        raise TypeError(f"produce must return (x, y) or yield (x, y) pairs, got {type(out).__name__}")
    return _checked_pairs(out)


def _checked_pairs(out: Iterable[Any]) -> Iterable[tuple[Any, Any]]:
    for item in out:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"produce must yield (x, y) pairs, got {type(item).__name__}")
        yield item


def commit_in_order(
    w: StoreWriter,
    pool: OrderedPool | EnginePool,
    tasks: Sequence[Any],
    start: int,
    ledger: Ledger,
    *,
    report: Callable[[int], None],
) -> int:
    """Run ``pool``'s producer (a :class:`TaskResults`) over ``tasks[start:]`` and append each result, in order,
    with its ledger entry ``ledger(index)``, then call ``report(samples of the task)``; returns the samples
    appended.  Results of tasks before a failing one are committed before the error is raised.

    Raises:
        ValidationError: a task's result does not fit the store (the message names the task).
        TaskError: ``produce`` raised, could not be imported by the workers, a worker died, or an engine lost
            a task.
    """
    added = 0
    results = pool.results(tasks, start)
    try:
        for index, (x, y, stats) in results:
            key, done, total = ledger(index)
            w.append(x, y, progress=(key, done), progress_total=total, stats=stats, copy=not pool.private_results)
            added += len(y)
            report(len(y))
    except (TaskFailure, WorkerDied, TaskLost) as exc:
        results.close()  # stop the workers before the commit
        w.commit()  # keep every task before the failing one
        raise as_error(exc, tasks, w.path) from exc
    finally:
        results.close()
    return added


def carry_error(exc: LmdbStoreError) -> LmdbStoreError:
    """Mark an error raised in a worker to be raised as itself (class, path, key, hint) in the parent, instead of
    being reported as the task's failure."""
    exc.carried = True  # type: ignore[attr-defined]  # travels with the pickled exception
    return exc


def as_error(exc: TaskFailure | WorkerDied | TaskLost, tasks: Sequence[Any], path: Path) -> Exception:
    """The error to raise in the parent for a failed task, a dead worker or a task an engine lost."""
    if isinstance(exc, TaskFailure) and getattr(exc.error, "carried", False):
        return exc.error  # type: ignore[return-value]
    if isinstance(exc, WorkerDied):
        return TaskError(exc.message, path=path, hint="look for an out-of-memory kill; rerun to resume")
    if isinstance(exc, TaskLost):
        return TaskError(
            f"task #{exc.index} ({clip(repr(tasks[exc.index]), REPR_CHARS)}) was lost with its worker: {exc.type_name}: "
            f"{exc.message}",
            path=path,
            key=exc.index,
            hint="the engine did not retry it (or gave up); rerun the same call to resume from this task",
        )
    if exc.index == LOAD_FAILED:
        return TaskError(
            f"worker processes cannot load produce: {exc.type_name}: {exc.message}",
            path=path,
            hint="define produce at module level in an importable module (guard scripts with if __name__ == '__main__')",
        )
    where = f"task #{exc.index} ({clip(repr(tasks[exc.index]), REPR_CHARS)})"
    if exc.type_name == "ValidationError":
        return ValidationError(f"{where}: {exc.message}", path=path, key=exc.index)
    error = TaskError(f"{where} raised {exc.type_name}: {exc.message}", path=path, key=exc.index)
    error.remote_traceback = exc.tb
    return error


def write_parallel(
    store: str | os.PathLike[str],
    produce: Callable[[Any], Any],
    tasks: Iterable[Any],
    *,
    workers: int | None = None,
    executor: Any = None,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
    classes: Sequence[str] | None = None,
    config: WriterConfig | None = None,
    name: str | None = None,
    task_id: Callable[[Any], Any] | None = None,
    in_flight: int = DEFAULT_IN_FLIGHT,
    cast: bool = False,
    progress: bool = True,
) -> ParallelReport:
    """Run ``produce(task)`` for every task in ``workers`` processes, or on ``executor``, and write the results
    into ``store``.

    ``produce(task)`` returns ``(x, y)`` -- samples ``(n, *shape)`` and ``n`` labels (ids or class names) --
    or yields several such pairs.  It must be a module-level function (workers are *spawned* and import
    it), and should be deterministic per task for a resumed run to equal an uninterrupted one.  Results
    are validated in the workers (the writer's own checks) and committed by one writer in this process in task
    order, each task's samples in one transaction with the ledger, so the store is the same for any ``workers``
    and any executor.  Calling again after a crash or Ctrl-C resumes the run (its name and its tasks): see
    :mod:`~lmdbstore.ingestion.parallel_runs` for which runs resume, extend or are refused.

    Args:
        store: store directory (created if needed: then ``shape``, ``dtype`` and ``classes`` are required).
        produce: ``task -> (x, y)`` or a generator of ``(x, y)``.
        tasks: small picklable descriptors (seeds, paths, ranges), written in their order (an unordered
            collection in the order of its tasks' identities), each identifiable by content
            (:mod:`~lmdbstore.ingestion.task_identity`), else give ``task_id``.
        workers: worker processes of the local pool; ``0`` runs ``produce`` in this process (for debugging);
            at most 4 per core and what memory holds (clipped with a warning).  With ``executor``: the tasks it
            runs at once, to size the window (default: what the executor tells, else 1).
        executor: run the tasks on an engine you already run instead of the local spawned pool: any
            ``concurrent.futures.Executor`` (``ProcessPoolExecutor``, ``dask_client.get_executor()``,
            :class:`~lmdbstore.ingestion.ray_executor.RayExecutor`) or a Dask ``distributed.Client``.
        config: writer settings (``commit_bytes`` bounds a transaction, but never splits a task).
        name: names the run in the ledger (default: ``produce``'s module and qualified name).
        task_id: ``task -> value`` naming each task (e.g. ``lambda t: t.key`` for tasks of your own class),
            identified instead of the task's content; called here only (default ``None``: the content).
        in_flight: results per worker produced and not yet committed (memory: about
            ``workers * in_flight`` task results; with an executor, also on the cluster); fewer where that many
            results would not fit in half the available memory (with a warning naming ``in_flight``).
        cast: convert samples of another dtype of the same kind (e.g. float64 -> float32).
        progress: show a tqdm bar (tasks, samples/s) on stderr.

    Raises:
        ValueError: bad ``workers``/``in_flight``/``executor``, ``produce`` not importable, a task without
            a content identity (naming it; nothing is written), or another run of the same name in the store
            that these tasks neither resume nor extend (unfinished, or of other tasks).
        ValidationError: a result does not fit the store (names the task); earlier tasks stay committed.
        TaskError: ``produce`` raised (names the task), a worker died, or the executor lost a task with its
            worker and did not retry it (names the task); earlier tasks stay committed.
        StoreExistsError, StoreLockedError, StoreFullError...: as :func:`~lmdbstore.open_writer`.
    """
    engine = _check_runner(workers, executor, in_flight)
    task_list = ordered_tasks(tasks, task_id)  # a set: in the order of its tasks' identities
    if workers or engine is not None:
        try:
            pickle.dumps(produce)
        except Exception as exc:
            raise ValueError(
                f"produce must be a module-level function that worker processes can import ({exc})"
            ) from None
    run = name or f"{getattr(produce, '__module__', '?')}.{getattr(produce, '__qualname__', '?')}"
    ids = TaskIdentities(task_list, task_id)  # before the store is touched: a task without identity is refused
    config = config or WriterConfig()
    path = Path(store)
    if engine is not None:
        engine.start()  # before the writer opens (see FuturesEngine.start)
    t0 = time.perf_counter()
    with writing(path, t0, shape=shape, dtype=dtype, classes=classes, config=config) as (w, outcome):
        plan = plan_run(w.progress_entries(), run, task_list, ids)
        key, start = plan.key, plan.start
        m = w.meta
        producer = TaskResults(produce, m.shape, m.dtype, tuple(m.classes), config.allow_nonfinite, cast)
        n = len(task_list)
        bar = progress_bar(run[-40:], total=n, initial=start, unit="task", enabled=progress)
        t_run, added = time.perf_counter(), [0]

        def report(samples: int) -> None:
            added[0] += samples
            bar.update(1)
            bar.set_postfix_str(f"{added[0] / max(time.perf_counter() - t_run, 1e-9):,.0f} samples/s", refresh=False)

        local = worker_processes(workers or 0)
        pool = (
            OrderedPool(producer, local, max(1, local) * in_flight)
            if engine is None
            else EnginePool(producer, engine, in_flight, workers)
        )
        try:
            if start < n:
                commit_in_order(w, pool, task_list, start, lambda i: (key, i + 1, n), report=report)
        finally:
            bar.close()
    return ParallelReport(str(path), n, start, outcome.added, outcome.total, outcome.seconds)


def _check_runner(workers: int | None, executor: Any, in_flight: int) -> Engine | None:
    """The engine of ``executor`` (``None``: the local pool), after checking the arguments that choose it.

    Raises:
        ValueError: ``in_flight`` below 1; no ``workers`` and no ``executor``; ``workers`` below 0, or below 1
            with an executor; an ``executor`` that is none of the kinds :func:`engine_of` knows.
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be positive, got {in_flight}")
    if executor is None:
        if workers is None:
            raise ValueError("workers: give a number of worker processes (0: this process), or an executor")
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        return None
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be positive with an executor (the tasks it runs at once), got {workers}")
    return engine_of(executor)
