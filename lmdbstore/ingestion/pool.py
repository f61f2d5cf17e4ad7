"""A small spawn-context process pool that hands results back in task order, with back-pressure.

Why not ``multiprocessing.Pool`` or ``ProcessPoolExecutor``: ``Pool.imap`` feeds every task at once and
queues results without bound, ``Pool`` hangs forever when a worker is killed (it silently replaces it),
and neither (before Python 3.14) can stop its workers at once on Ctrl-C.  This pool keeps at most
``limit`` tasks submitted and not yet consumed, notices a dead worker, and terminates its workers on
any exit from :meth:`OrderedPool.results`.

Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent decides) and
exit by themselves when their parent disappears, so a killed parent leaves no orphans behind.
Results travel as pickled numpy arrays through a pipe (the data out of band, read into uninitialized buffers
that the writer keeps without copying).  Shared memory would not be cheaper: per 10 MB result the pipe costs
the writer about 2 ms of CPU and the worker about 2.5 ms, while writing the result into a file in ``/dev/shm``
cost the worker 5.5 ms (tmpfs allocates and zeroes every page, and frees them again) and mapping it the writer
2.5-3 ms -- and it adds files to clean up after crashes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import struct
import threading
import traceback
import warnings
from collections.abc import Callable, Generator, Sequence
from multiprocessing.connection import wait
from typing import Any

import numpy as np

from lmdbstore.util.allocator import keep_large_blocks
from lmdbstore.util.memory import DEFAULT_SHARE, MemoryBoundWarning, available_memory, describe_bytes

__all__ = ["LOAD_FAILED", "OrderedPool", "ResultBudget", "TaskFailure", "WorkerDied", "pickled_task", "result_bytes"]

#: How often (seconds) a waiting side checks that the other side is still alive.
POLL_SECONDS = 0.5
#: Index reported when a worker cannot unpickle the function it should run.
LOAD_FAILED = -1
#: Seconds a terminated worker gets to exit before it is killed.
TERMINATE_GRACE = 2.0


def result_bytes(result: Any) -> int:
    """The bytes of a task's result held in memory: its numpy arrays (and those of a tuple or list of them)."""
    if isinstance(result, np.ndarray):
        return int(result.nbytes)
    if isinstance(result, (tuple, list)):
        return sum(result_bytes(r) for r in result)
    return 0


class ResultBudget:
    """How many task results a run may hold at once, by their bytes: ``share`` of the memory available when it
    starts (:func:`~lmdbstore.util.memory.available_memory`).  Results produced and not yet committed are held in
    this process (the local pool reads them off the pipes while it waits for the next in order; an executor's
    futures keep theirs), so the count asked for (``in_flight`` per worker) is lowered to what the budget holds at
    the largest result seen so far -- with a :class:`~lmdbstore.util.memory.MemoryBoundWarning` naming
    ``in_flight`` -- and, until a first result says how large they are, to two per worker.

    Args:
        workers: the tasks that run at once (at least one each is always allowed).
        available: bytes available (default: read now).
    """

    def __init__(self, workers: int, available: int | None = None, share: float = DEFAULT_SHARE) -> None:
        self.workers = max(1, workers)
        self.budget = int((available_memory() if available is None else available) * share)
        self.largest = 0
        self._warned = False

    def observe(self, result: Any) -> None:
        """Note a result received (its size bounds the window from now on)."""
        self.largest = max(self.largest, result_bytes(result))

    def window(self, limit: int) -> int:
        """The tasks that may be submitted and not yet consumed now, of the ``limit`` asked for."""
        if self.largest == 0:
            return min(limit, 2 * self.workers)
        fits = max(1, self.budget // self.largest)
        if fits < limit and not self._warned:
            self._warned = True
            warnings.warn(
                f"in_flight: {limit:,} task results of up to {describe_bytes(self.largest)} in flight would take "
                f"{describe_bytes(limit * self.largest)}, more than this machine can give ({describe_bytes(self.budget)}); "
                f"keeping {fits:,} in flight",
                MemoryBoundWarning,
                stacklevel=4,
            )
        return min(limit, fits)


class TaskFailure(Exception):
    """A task raised in a worker; carries the exception's type name, message and traceback text."""

    def __init__(self, index: int, type_name: str, message: str, tb: str, payload: Any = None) -> None:
        super().__init__(f"{type_name}: {message}")
        self.index, self.type_name, self.message, self.tb, self.payload = index, type_name, message, tb, payload


class WorkerDied(Exception):
    """A worker process ended without being asked to (killed, out of memory, os._exit)."""

    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"a worker process died (exit code {exitcode})")
        self.exitcode = exitcode


_FRAME = struct.Struct("<QI")  # pickle bytes, out-of-band buffers


def send(fd: int, obj: Any) -> None:
    """Write ``obj`` to pipe ``fd``: pickle protocol 5 with numpy data out of band, written straight
    from the arrays (no copy into the pickle)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    lengths = struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    parts: list[memoryview] = [memoryview(_FRAME.pack(len(head), len(raws)) + lengths + head), *raws]
    for part in parts:
        view = part.cast("B")
        while view:
            view = view[os.write(fd, view) :]


def _read_exactly(fd: int, n: int) -> bytearray:
    out = bytearray(n)
    _read_into(fd, memoryview(out))
    return out


def _read_buffer(fd: int, n: int) -> np.ndarray:
    """``n`` bytes from ``fd`` into a new uninitialized buffer (a ``bytearray`` would zero its bytes first)."""
    out = np.empty(n, np.uint8)
    _read_into(fd, memoryview(out).cast("B"))  # type: ignore[arg-type]  # numpy arrays are buffers
    return out


def _read_into(fd: int, view: memoryview) -> None:
    n, got = len(view), 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError("pipe closed")
        got += k


def receive(fd: int) -> Any:
    """Read one object written by :func:`send`; each array's data is read once, into its own buffer."""
    head_len, n = _FRAME.unpack(_read_exactly(fd, _FRAME.size))
    lengths = struct.unpack(f"<{n}Q", _read_exactly(fd, 8 * n)) if n else ()
    head = _read_exactly(fd, head_len)
    return pickle.loads(head, buffers=[_read_buffer(fd, k) for k in lengths])


def _worker_main(fn_blob: bytes, tasks: Any, results: Any, parent: int) -> None:
    """Worker loop: take ``(index, pickled task)`` from this worker's own pipe ``tasks``, send
    ``(index, ok, payload)`` pickled through its own pipe ``results``, until ``None``.

    Both directions are plain pipes, one pair per worker: no queue, lock or semaphore is shared, so
    nothing is left for multiprocessing's resource tracker to clean up (or to warn about) however the
    run ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_large_blocks()  # spawned from a process that made a Dask LocalCluster, it inherits Dask's setting
    try:
        fn = pickle.loads(fn_blob)
    except Exception as exc:  # e.g. the function lives in a module the worker cannot import
        text = "".join(traceback.format_exception(exc))
        send(results.fileno(), (LOAD_FAILED, False, (type(exc).__name__, str(exc), text, None)))
        return
    while True:
        try:
            if not tasks.poll(POLL_SECONDS):
                if os.getppid() != parent:
                    os._exit(0)  # orphaned: the parent was killed
                continue
            item = tasks.recv()
        except (EOFError, OSError):
            return  # the parent closed our task pipe (or is gone)
        if item is None:
            return
        index, blob = item
        try:
            out: tuple[bool, Any] = (True, fn(pickle.loads(blob)))
        except BaseException as exc:  # reported to the parent, which stops the run
            text = "".join(traceback.format_exception(exc))
            out = (False, (type(exc).__name__, str(exc), text, getattr(exc, "payload", None)))
        try:
            send(results.fileno(), (index, *out))  # blocks while the parent is behind: back-pressure
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            text = "".join(traceback.format_exception(exc))
            send(results.fileno(), (index, False, (type(exc).__name__, f"result cannot be pickled: {exc}", text, None)))
        except OSError:
            os._exit(0)  # the parent is gone


def pickled_task(tasks: Sequence[Any], i: int) -> bytes:
    """``tasks[i]`` pickled, as every pool sends a task to its workers.

    Raises:
        ValueError: the task cannot be pickled (names its index).
    """
    try:
        return pickle.dumps(tasks[i], protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise ValueError(f"tasks[{i}] cannot be sent to a worker process ({exc})") from None


class _Feeder:
    """Sends tasks down one worker's task pipe from a thread of its own.

    A task can be larger than a pipe's buffer; sent from the parent's own thread it could block while that
    worker, busy with an earlier task, itself blocks sending a result the parent is not reading yet.  The
    feeder thread takes that wait instead, as ``multiprocessing.Queue``'s feeder does, but with no shared
    semaphore for the resource tracker to keep.
    """

    def __init__(self, conn: Any) -> None:
        self.conn, self.busy = conn, 0  # busy: tasks given to this worker and not yet answered
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lmdbstore-pool-feeder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not _STOP:
            try:
                self.conn.send(item)
            except OSError:  # the worker is gone; the pool notices through its result pipe
                return

    def put(self, item: Any) -> None:
        """Queue ``item`` for the worker (never blocks)."""
        self._q.put(item)

    def close(self) -> None:
        """Stop the thread (after its worker is stopped, so a blocked send fails at once) and close the pipe."""
        self._q.put(_STOP)
        self._thread.join(TERMINATE_GRACE)
        self.conn.close()


_STOP = object()


class OrderedPool:
    """``workers`` spawned processes running ``fn(task)``; :meth:`results` yields outputs in task order.

    ``fn`` must be picklable by reference (a module-level function), since spawned workers import it.
    ``workers=0`` runs ``fn`` in the calling process (same interface; for debugging and tests).
    """

    def __init__(self, fn: Callable[[Any], Any], workers: int, limit: int) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        self.fn, self.workers, self.limit = fn, workers, limit
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._feeders: list[_Feeder] = []  # parent -> worker task pipes, one per worker

    @property
    def private_results(self) -> bool:
        """Results are unpickled here from the workers' pipes (not with ``workers=0``: ``fn``'s own objects)."""
        return self.workers > 0

    def results(self, tasks: Sequence[Any], start: int = 0) -> Generator[tuple[int, Any], None, None]:
        """Yield ``(index, fn(tasks[index]))`` for ``index`` from ``start`` on, in order.

        At most ``limit`` tasks are submitted and not yet yielded, fewer where their results would take more
        memory than the machine can give (:class:`ResultBudget`).  Leaving the generator for any
        reason (exhausted, an exception, ``close()``, KeyboardInterrupt) stops every worker.

        Raises:
            TaskFailure: ``fn`` raised for the task at the head of the order.
            WorkerDied: a worker ended unexpectedly.
        """
        if self.workers == 0:
            for i in range(start, len(tasks)):
                try:
                    out = self.fn(tasks[i])
                except Exception as exc:
                    text = "".join(traceback.format_exception(exc))
                    raise TaskFailure(i, type(exc).__name__, str(exc), text, getattr(exc, "payload", None)) from exc
                yield i, out
            return
        ctx = mp.get_context("spawn")
        fn_blob = pickle.dumps(self.fn)
        try:
            n_procs = min(self.workers, max(len(tasks) - start, 1))
            for _ in range(n_procs):
                rx, tx = ctx.Pipe(duplex=False)
                task_rx, task_tx = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main, args=(fn_blob, task_rx, tx, os.getpid()), daemon=True)
                p.start()
                tx.close()  # the worker holds the only write end: its death closes the pipe
                task_rx.close()
                self._procs.append(p)
                self._conns.append(rx)
                self._feeders.append(_Feeder(task_tx))
            nxt, head, ready = start, start, {}
            budget = ResultBudget(n_procs)
            while head < len(tasks):
                while nxt < len(tasks) and (nxt == head or nxt - head < budget.window(self.limit)):
                    feeder = min(self._feeders, key=lambda f: f.busy)  # the least busy worker takes it
                    feeder.put((nxt, pickled_task(tasks, nxt)))
                    feeder.busy += 1
                    nxt += 1
                while head not in ready and LOAD_FAILED not in ready:
                    w, (index, ok, payload) = self._receive()
                    self._feeders[w].busy -= 1
                    ready[index] = (ok, payload)
                    budget.observe(payload)
                if LOAD_FAILED in ready:
                    raise TaskFailure(LOAD_FAILED, *ready[LOAD_FAILED][1])
                ok, payload = ready.pop(head)
                if not ok:
                    raise TaskFailure(head, *payload)
                yield head, payload
                head += 1
            for feeder in self._feeders:
                feeder.put(None)
            for p in self._procs:
                p.join(TERMINATE_GRACE)
        finally:
            self._stop()

    def _receive(self) -> tuple[int, tuple[int, bool, Any]]:
        """``(worker, result)`` of the next result any worker sends; raises WorkerDied when one ends instead."""
        while True:
            for conn in wait(self._conns, timeout=POLL_SECONDS):
                try:
                    return self._conns.index(conn), receive(conn.fileno())  # type: ignore[union-attr,arg-type]
                except EOFError:  # its worker ended
                    proc = self._procs[self._conns.index(conn)]
                    proc.join(TERMINATE_GRACE)
                    raise WorkerDied(proc.exitcode) from None
            for p in self._procs:
                if p.exitcode is not None:
                    raise WorkerDied(p.exitcode)

    def _stop(self) -> None:
        """Terminate (then kill) every worker still running and reap them all."""
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(TERMINATE_GRACE)
            if p.is_alive():
                p.kill()
                p.join()
        for feeder in self._feeders:
            feeder.close()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._feeders = [], [], []
