"""Producers on an engine the user already runs: :func:`write_parallel`'s tasks on a ``concurrent.futures``
executor, a Dask ``distributed.Client`` or Ray, with the guarantees of the local pool.

:class:`EnginePool` has :class:`~lmdbstore.util.pool.OrderedPool`'s interface, so the single writer commits the
same way whatever runs the producers: in task order, each task with its ledger entry, at most a window of tasks
submitted and not yet consumed.  A task that raised is a :class:`~lmdbstore.util.pool.TaskFailure`; one the
engine lost with its worker and did not retry, a :class:`TaskLost`.  Tasks travel as
:func:`~lmdbstore.util.pool.pickled_task` bytes, so no engine interprets them (Dask would call a tuple whose
first item is callable).
"""

from __future__ import annotations

import concurrent.futures as cf
import pickle
import sys
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from lmdbstore.util.allocator import keep_large_blocks
from lmdbstore.util.memory import ResultBudget
from lmdbstore.util.pool import TaskFailure, pickled_task

__all__ = [
    "LOST_WORKER_ERRORS",
    "RESIZE_SECONDS",
    "TASK_KEY",
    "CallPickled",
    "DaskEngine",
    "Engine",
    "EnginePool",
    "FuturesEngine",
    "TaskLost",
    "as_failure",
    "engine_of",
]

#: Seconds between two looks at how many workers an engine has (the window follows a cluster that grows).
RESIZE_SECONDS = 2.0
#: What a task's key starts with on a Dask cluster (its dashboard groups the tasks by it).
TASK_KEY = "lmdbstore-task"
#: Exception classes (by name, anywhere in the MRO: neither Dask nor Ray is imported to check) that mean the engine
#: lost the task (a worker or node died, the pool broke, the future was cancelled...) rather than that it raised.
LOST_WORKER_ERRORS = frozenset(
    {
        "BrokenExecutor",  # concurrent.futures: BrokenProcessPool, BrokenThreadPool
        "CancelledError",  # concurrent.futures, Dask's FutureCancelledError
        "KilledWorker",  # Dask: the task's workers died allowed-failures + 1 times
        "CommClosedError",  # Dask: the connection to the scheduler or worker closed
        "WorkerCrashedError",  # Ray
        "NodeDiedError",
        "ObjectLostError",  # Ray: ObjectReconstructionFailedError, OwnerDiedError, ...
        "RaySystemError",
    }
)


class TaskLost(Exception):
    """The engine gave up on task ``index``: ``type_name``/``message`` are what it raised (e.g. KilledWorker)."""

    def __init__(self, index: int, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.index, self.type_name, self.message = index, type_name, message


@dataclass(frozen=True)
class CallPickled:
    """What an engine runs: ``fn(pickle.loads(blob))`` for a task sent as :func:`pickled_task` bytes, after
    :func:`lmdbstore.util.allocator.keep_large_blocks` (for workers that pin glibc's thresholds, as Dask's do)."""

    fn: Callable[[Any], Any]

    def __call__(self, blob: bytes) -> Any:
        keep_large_blocks()
        return self.fn(pickle.loads(blob))


class FuturesEngine:
    """Any ``concurrent.futures.Executor`` (``ProcessPoolExecutor``, a Dask ``client.get_executor()``,
    :class:`~lmdbstore.ingestion.ray_executor.RayExecutor`, ...): anything whose ``submit(fn, arg)`` returns a
    future with ``result()`` and ``cancel()``.  :attr:`private_results`: every result is a copy made for this
    process, which the writer may keep without copying it."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def submit(self, fn: Callable[[bytes], Any], blob: bytes) -> Any:
        return self.executor.submit(fn, blob)

    def result(self, handle: Any) -> Any:
        return handle.result()

    def cancel(self, handles: list[Any]) -> None:
        for h in handles:
            h.cancel()

    @property
    def private_results(self) -> bool:
        """A ``ProcessPoolExecutor``'s results are unpickled here; other executors' may be the producers' own
        objects (a thread pool's are)."""
        return isinstance(self.executor, cf.ProcessPoolExecutor)

    def workers(self) -> int | None:
        """``max_workers`` of the standard executors (read from their ``_max_workers``), or the executor's own
        ``workers`` attribute (``RayExecutor`` has one); ``None`` otherwise."""
        n = getattr(self.executor, "_max_workers", None) or getattr(self.executor, "workers", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    def start(self) -> None:
        """Run one trivial task and wait for it: a ``ProcessPoolExecutor`` that forks starts all its workers at
        its first task, and workers forked after the store's writer opened would inherit its lock and files.

        Raises:
            ValueError: the executor cannot run a task (shut down, broken).
        """
        try:
            self.executor.submit(int).result()
        except Exception as exc:
            raise ValueError(f"executor cannot run a task ({type(exc).__name__}: {exc})") from None


class DaskEngine:
    """A Dask ``distributed.Client``: tasks submitted under unique keys (every call runs), results gathered one
    at a time in task order and released at once, so the cluster holds at most the window's results; straight
    from the worker (``direct=True``) when the client says so or manages its cluster itself, else through the
    scheduler (Dask's default for clients that may not reach the workers)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        direct = getattr(client, "direct_to_workers", None)
        self.direct = bool(direct) if direct is not None else getattr(client, "cluster", None) is not None

    def submit(self, fn: Callable[[bytes], Any], blob: bytes) -> Any:
        return self.client.submit(fn, blob, key=f"{TASK_KEY}-{uuid.uuid4().hex}")

    def result(self, handle: Any) -> Any:
        out = self.client.gather(handle, direct=self.direct)
        handle.release()  # the worker may drop the result now
        return out

    def cancel(self, handles: list[Any]) -> None:
        if handles and self.client.status == "running":
            self.client.cancel(handles)

    @property
    def private_results(self) -> bool:
        """Results gathered over a connection (``tcp://``, ...) are deserialized here; a cluster inside this
        process (``inproc://``, ``LocalCluster(processes=False)``) hands over the producers' own objects."""
        address = getattr(getattr(self.client, "scheduler", None), "address", None)
        return isinstance(address, str) and not address.startswith("inproc://")

    def workers(self) -> int | None:
        """The threads of the cluster's workers now (``None`` while it has none)."""
        return sum(self.client.nthreads().values()) or None

    def start(self) -> None:
        """Nothing to start: Dask's workers are processes of their own, never forked from this one.

        Raises:
            ValueError: the client is closed.
        """
        if self.client.status not in ("running", "connecting"):
            raise ValueError(f"executor: the Dask client is {self.client.status}")


#: What :class:`EnginePool` runs tasks on.
Engine = FuturesEngine | DaskEngine


def engine_of(executor: Any) -> Engine:
    """The :class:`Engine` for ``executor``: a Dask ``distributed.Client``, or anything with ``submit`` that
    returns futures (every ``concurrent.futures.Executor``).

    Raises:
        ValueError: ``executor`` has no ``submit``.
    """
    distributed = sys.modules.get("distributed")  # a Client exists only if Dask's distributed was imported
    if distributed is not None and isinstance(executor, distributed.Client):
        return DaskEngine(executor)
    if callable(getattr(executor, "submit", None)):
        return FuturesEngine(executor)
    raise ValueError(
        f"executor must be a concurrent.futures.Executor (or anything with submit() returning futures) "
        f"or a dask.distributed Client, got {type(executor).__name__}"
    )


def _remote_traceback(exc: BaseException) -> str:
    """The worker's traceback text: ProcessPoolExecutor attaches it as the exception's cause; Dask rebuilds
    the remote frames on the exception itself; Ray's task errors carry it in their text."""
    remote = getattr(exc.__cause__, "tb", None)
    if isinstance(remote, str):
        return remote
    return "".join(traceback.format_exception(exc))


def as_failure(exc: BaseException, index: int) -> TaskFailure | TaskLost:
    """What an engine raised for task ``index``, as the pool reports it: :class:`TaskLost` when the engine lost
    the task (:data:`LOST_WORKER_ERRORS`), else :class:`TaskFailure` with ``produce``'s own exception (a Ray
    ``RayTaskError`` is unwrapped to its ``cause``)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & LOST_WORKER_ERRORS:
        text = str(exc).strip().splitlines()
        return TaskLost(index, type(exc).__name__, text[0] if text else "")
    cause: BaseException = exc
    if "RayTaskError" in names and isinstance(getattr(exc, "cause", None), BaseException):
        cause = exc.cause  # type: ignore[attr-defined]
    return TaskFailure(index, cause, _remote_traceback(exc))


class EnginePool:
    """``fn(task)`` on ``engine``, results in task order, at most a window of tasks submitted and not yet consumed.

    The window is ``in_flight * workers`` tasks (fewer where their results would not fit in memory:
    :class:`~lmdbstore.util.memory.ResultBudget`); ``workers=None`` takes the engine's own count
    (:meth:`Engine.workers`, asked again every :data:`RESIZE_SECONDS` while the run goes on, so a cluster that
    grows gets a larger window; 1 while it tells nothing).  ``in_flight`` and ``workers`` (at least 1) are checked
    by :func:`~lmdbstore.ingestion.parallel.write_parallel`; a task that cannot be pickled is a ``ValueError``.
    """

    def __init__(self, fn: Callable[[Any], Any], engine: Engine, in_flight: int, workers: int | None = None) -> None:
        self.call, self.engine, self.in_flight, self.workers = CallPickled(fn), engine, in_flight, workers
        self._capacity, self._next_check = 1, 0.0

    @property
    def private_results(self) -> bool:
        """Whether the results are copies made for this process (:attr:`Engine.private_results`)."""
        return self.engine.private_results

    @property
    def limit(self) -> int:
        """Tasks the window holds now."""
        if self.workers is not None:
            return self.in_flight * self.workers
        now = time.monotonic()
        if now >= self._next_check:
            self._capacity = self.engine.workers() or self._capacity
            self._next_check = now + RESIZE_SECONDS
        return self.in_flight * self._capacity

    def results(self, tasks: Sequence[Any], start: int = 0) -> Generator[tuple[int, Any], None, None]:
        """Yield ``(index, fn(tasks[index]))`` for ``index`` from ``start`` on, in order; leaving the generator
        cancels the tasks still in the window, and a refused submission comes after the tasks already submitted.

        Raises:
            TaskFailure: ``fn`` raised for the task at the head of the order.
            TaskLost: the engine lost that task with its worker and did not retry it.
        """
        window: deque[tuple[int, Any]] = deque()
        nxt, refused = start, None
        budget: ResultBudget | None = None
        try:
            while nxt < len(tasks) or window:
                limit = self.limit
                budget = budget or ResultBudget(max(1, limit // self.in_flight))
                limit = budget.window(limit)
                while refused is None and nxt < len(tasks) and len(window) < limit:
                    blob = pickled_task(tasks, nxt)
                    try:
                        window.append((nxt, self.engine.submit(self.call, blob)))
                        nxt += 1
                    except Exception as exc:  # e.g. a pool broken meanwhile: first the tasks already out
                        refused = as_failure(exc, nxt)
                if not window:  # only when a submission was refused: its task is the next in order
                    raise refused  # type: ignore[misc]
                index, handle = window.popleft()
                try:
                    out = self.engine.result(handle)
                except Exception as exc:
                    raise as_failure(exc, index) from exc
                del handle
                budget.observe(out)
                yield index, out
        finally:
            self.engine.cancel([h for _, h in window])
