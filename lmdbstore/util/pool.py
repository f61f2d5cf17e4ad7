"""The ordered pool: ``fn(task)`` over a task list in worker processes (:class:`~lmdbstore.util.workers.Workers`),
results in task order, with back-pressure -- the ingest's and ``write_parallel``'s producers, ``verify``'s value pass.

Unlike ``multiprocessing.Pool`` (whose ``imap`` queues results without bound, and which hangs when a worker is
killed), at most ``limit`` tasks are in flight, fewer where the results would not fit in memory (:meth:`results`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from lmdbstore.util.allocator import keep_large_blocks
from lmdbstore.util.memory import ResultBudget
from lmdbstore.util.procs import needs_main
from lmdbstore.util.workers import STOP_SECONDS, WorkerDied, Workers, remote_traceback

__all__ = ["LOAD_FAILED", "OrderedPool", "TaskFailure", "pickled_task"]

#: :attr:`TaskFailure.index` when the workers could not load the pool's function.
LOAD_FAILED = -1


class TaskFailure(Exception):
    """A pool's function raised for task ``index`` (:data:`LOAD_FAILED`: the workers could not load it).

    Attributes:
        error: the exception, as raised in the worker (see the module docstring).
        type_name, message, tb: its type's name, its text and the worker's traceback text.
    """

    def __init__(self, index: int, error: BaseException, tb: str | None = None) -> None:
        self.index, self.error = index, error
        self.type_name, self.message = type(error).__name__, str(error)
        self.tb = tb if tb is not None else remote_traceback(error)
        super().__init__(f"{self.type_name}: {self.message}")


def pickled_task(tasks: Sequence[Any], i: int) -> bytes:
    """``tasks[i]`` pickled, as every pool sends a task to its workers.

    Raises:
        ValueError: the task cannot be pickled (names its index).
    """
    try:
        return pickle.dumps(tasks[i], protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(f"tasks[{i}] cannot be sent to a worker process ({exc})") from None


@dataclass(frozen=True)
class _Tasks:
    """A pool worker's function: ``fn`` on each pickled task."""

    fn: Callable[[Any], Any]

    def start(self) -> None:
        keep_large_blocks()  # spawned from a process that made a Dask LocalCluster, it inherits Dask's setting

    def __call__(self, blob: bytes) -> Any:
        return self.fn(pickle.loads(blob))


class OrderedPool:
    """``workers`` spawned processes running ``fn(task)``; :meth:`results` yields outputs in task order.

    ``fn`` must be picklable by reference (a module-level function), since spawned workers import it.
    ``workers=0`` runs ``fn`` in the calling process (same interface; for debugging and tests).  ``main``: whether
    unpickling ``fn`` may need the main script (``None``: :func:`~lmdbstore.util.procs.needs_main` decides; give it
    for a ``fn`` holding a :class:`PassedFd`, which is pickled only as a worker starts).
    """

    def __init__(self, fn: Callable[[Any], Any], workers: int, limit: int, main: bool | None = None) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        self.fn, self.workers, self.limit, self.main = fn, workers, limit, main

    @property
    def private_results(self) -> bool:
        """Results are unpickled here from the workers' pipes (not with ``workers=0``: ``fn``'s own objects)."""
        return self.workers > 0

    def results(self, tasks: Sequence[Any], start: int = 0) -> Generator[tuple[int, Any], None, None]:
        """Yield ``(index, fn(tasks[index]))`` for ``index`` from ``start`` on, in order, with at most ``limit``
        tasks not yet yielded, fewer where their results would not fit in memory
        (:class:`~lmdbstore.util.memory.ResultBudget`).  Leaving the generator for any reason stops every worker.

        Raises:
            TaskFailure: ``fn`` raised for the task at the head of the order (or could not be loaded).
            WorkerDied: a worker ended unexpectedly.
        """
        n = min(self.workers, len(tasks) - start)
        if self.workers == 0 or n <= 0:
            for i in range(start, len(tasks)):
                try:
                    out = self.fn(tasks[i])
                except Exception as exc:
                    raise TaskFailure(i, exc) from exc
                yield i, out
            return
        main = needs_main(self.fn) if self.main is None else self.main
        try:
            team = Workers(_Tasks(self.fn), n, "spawn", "a worker process", main=main)
        except WorkerDied:
            raise
        except Exception as exc:
            raise TaskFailure(LOAD_FAILED, exc) from exc
        wait, nxt, budget = 0.0, start, ResultBudget(n)
        try:
            for head in range(start, len(tasks)):
                while nxt < len(tasks) and (nxt == head or nxt - head < budget.window(self.limit)):
                    team.send(pickled_task(tasks, nxt), later=True)
                    nxt += 1
                try:
                    out = team.answer()
                except WorkerDied:
                    raise
                except Exception as exc:
                    raise TaskFailure(head, exc) from exc
                budget.observe(out)
                yield head, out
            wait = STOP_SECONDS
        finally:
            team.close(wait)
