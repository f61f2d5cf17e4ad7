"""Worker processes: the one way lmdbstore starts, talks to, watches and stops them (the ingest and
``write_parallel`` pool, the feed's readers, ``verify``'s value pass and page walk).

A :class:`Worker` is one process started by a named method (:func:`~lmdbstore.util.procs.start_method` decides
which is safe) that calls a function on each request it is sent and answers each in order:

* **Start**: the function is pickled as the process starts, so the descriptors it holds (:class:`PassedFd`)
  travel with it, and unpickled by the worker itself: a function the worker cannot import is a failure it
  reports, not a crash.  Its optional ``start()`` runs first; the worker then says it is ready (:meth:`Worker.ready`).
* **Lifeline**: the worker ignores Ctrl-C (the owner decides) and dies with its owner whatever kills it
  (:class:`~lmdbstore.util.lifeline.Lifeline`): a killed owner leaves nothing behind.
* **Transport**: requests and answers cross one pipe as pickles with numpy data out of band, written straight from
  the arrays and read into uninitialized buffers the receiver keeps without copying.  Shared memory would not be
  cheaper: per 10 MB answer the pipe costs the owner about 2 ms of CPU and the worker 2.5 ms, while a file in
  ``/dev/shm`` cost the worker 5.5 ms (tmpfs zeroes and frees every page) and mapping it 2.5-3 ms -- and leaves
  files to clean up after crashes.  Nothing is shared but the pipe: no lock or semaphore for multiprocessing's
  resource tracker to warn about however a run ends.
* **Failures**: an exception the function raised is raised in the owner as itself (its type, its message; a
  one-line :class:`~lmdbstore.errors.LmdbStoreError` naming the type where it cannot travel), the worker's
  traceback text its cause (:class:`RemoteTraceback`).  A worker that ends without answering (killed, out of
  memory) is a :class:`WorkerDied` naming it, its pid and exit code.
* **Stop**: :func:`stop` asks workers to finish what they were sent, terminates those still running after the
  time given, kills those still running :data:`TERMINATE_GRACE` later, and reaps them all.

:class:`OrderedPool` runs ``fn(task)`` over a task list on spawned workers and yields the results in task order,
with back-pressure (at most ``limit`` tasks submitted and not yet consumed, fewer where the results would not fit
in memory: :class:`~lmdbstore.util.memory.ResultBudget`).  Neither ``multiprocessing.Pool`` nor
``ProcessPoolExecutor`` does: ``Pool.imap`` feeds every task at once and queues results without bound, ``Pool``
hangs for good when a worker is killed, and neither can stop its workers at once (before Python 3.14).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import struct
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import numpy as np

from lmdbstore.errors import LmdbStoreError
from lmdbstore.util.allocator import keep_large_blocks
from lmdbstore.util.lifeline import Lifeline
from lmdbstore.util.memory import ResultBudget
from lmdbstore.util.procs import main_script_hidden, needs_main

__all__ = [
    "LOAD_FAILED",
    "STOP_SECONDS",
    "TERMINATE_GRACE",
    "OrderedPool",
    "PassedFd",
    "RemoteTraceback",
    "TaskFailure",
    "Worker",
    "WorkerDied",
    "first_ready",
    "pickled_task",
    "stop",
]

#: Seconds a worker asked to stop gets to finish what it was sent before it is terminated.
STOP_SECONDS = 5.0
#: Seconds a terminated worker gets to exit before it is killed.
TERMINATE_GRACE = 2.0
#: :attr:`TaskFailure.index` when the workers could not load the pool's function.
LOAD_FAILED = -1


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a worker (the cause of the one raised here)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


class WorkerDied(LmdbStoreError):
    """A worker process ended without being asked to (killed, out of memory, ``os._exit``).

    Attributes:
        exitcode: its exit code (``-9``: SIGKILL).
    """

    def __init__(self, message: str, exitcode: int | None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.exitcode = exitcode


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


def remote_traceback(error: BaseException) -> str:
    """The worker's traceback text of ``error`` (its own where it was raised here)."""
    if isinstance(error.__cause__, RemoteTraceback):
        return str(error.__cause__.args[0])
    return "".join(traceback.format_exception(error))


def _failure(exc: BaseException) -> tuple[bytes | None, str, str]:
    """What a worker sends for ``exc``: the exception pickled (``None`` where it cannot be), its type and first
    line, and the traceback."""
    try:
        pickled: bytes | None = pickle.dumps(exc)
    except Exception:
        pickled = None
    line = str(exc).splitlines()[0] if str(exc) else ""
    return pickled, f"{type(exc).__name__}: {line}", "".join(traceback.format_exception(exc))


def _rebuilt(failure: tuple[bytes | None, str, str], where: str) -> Exception:
    """The exception a worker sent (:func:`_failure`), raised here: see the module docstring."""
    pickled, line, text = failure
    exc = None
    with contextlib.suppress(Exception):
        exc = pickle.loads(pickled) if pickled is not None else None
    if not isinstance(exc, Exception):  # not sendable, or a BaseException (SystemExit...) the owner must not get
        exc = LmdbStoreError(f"{where} failed: {line}")
    exc.__cause__ = RemoteTraceback(text)
    exc.add_note(f"(raised in {where})")
    return exc


# ---------------------------------------------------------------------------------------------- the pipe
_FRAME = struct.Struct("<QI")  # pickle bytes, out-of-band buffers


def send(fd: int, obj: Any) -> None:
    """Write ``obj`` to pipe ``fd``: pickle protocol 5 with numpy data out of band, written straight from the
    arrays (pickled whole before the first byte is written)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    lengths = struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    for part in (memoryview(_FRAME.pack(len(head), len(raws)) + lengths + head), *raws):
        view = part.cast("B")
        while view:
            view = view[os.write(fd, view) :]


def _read_into(fd: int, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError("pipe closed")
        got += k


def _read(fd: int, n: int, array: bool = False) -> Any:
    """``n`` bytes from ``fd`` (``array``: into a new uninitialized numpy buffer; a ``bytearray`` is zeroed)."""
    out: Any = np.empty(n, np.uint8) if array else bytearray(n)
    _read_into(fd, memoryview(out).cast("B"))
    return out


def receive(fd: int) -> Any:
    """Read one object written by :func:`send`; each array's data is read once, into its own buffer."""
    head_len, n = _FRAME.unpack(_read(fd, _FRAME.size))
    lengths = struct.unpack(f"<{n}Q", _read(fd, 8 * n)) if n else ()
    head = _read(fd, head_len)
    return pickle.loads(head, buffers=[_read(fd, k, array=True) for k in lengths])


class PassedFd:
    """A descriptor on its way to a worker: inherited as it is by a forked one, duplicated into a spawned or
    forkserver one by ``multiprocessing`` as it starts (the way it passes connections)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> PassedFd:
    return PassedFd(dup.detach())


# ---------------------------------------------------------------------------------------------- one worker
class _AtStart:
    """``obj`` pickled as the process starts (descriptors travel then) and unpickled by the worker itself."""

    def __init__(self, obj: Any):
        self.obj = obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (bytes, (pickle.dumps(self.obj),))


def _nothing() -> None:
    pass


def _serve(fn: Any, conn: Any, lifeline: Lifeline) -> None:
    """A worker: load ``fn``, run its ``start()``, say ready, then answer each request on ``conn`` with
    ``(True, fn(request))`` or ``(False, failure)``, until ``None`` or the owner closes the pipe."""
    lifeline.attach()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, loaded = conn.fileno(), None
    try:
        try:
            loaded = pickle.loads(fn) if isinstance(fn, bytes) else fn.obj  # not pickled by fork
            getattr(loaded, "start", _nothing)()
        except BaseException as exc:
            send(fd, (False, _failure(exc)))
            return
        send(fd, (True, None))
        while (request := receive(fd)) is not None:
            try:
                answer: tuple[bool, Any] = (True, loaded(request))
            except BaseException as exc:  # sent to the owner, raised there
                answer = (False, _failure(exc))
            try:
                send(fd, answer)
            except (pickle.PicklingError, TypeError, AttributeError, BufferError) as exc:
                send(fd, (False, _failure(TypeError(f"the answer cannot be sent back ({exc})"))))
    except (EOFError, OSError):
        return  # the owner closed the pipe, or is gone
    finally:
        getattr(loaded, "close", _nothing)()


class Worker:
    """One worker process calling ``fn`` on each request (see the module docstring).

    Args:
        fn: picklable (a module-level function, or an object with ``__call__`` and optionally ``start()`` and
            ``close()``, run first and last in the worker).
        method: the start method (``"fork"``, ``"forkserver"``, ``"spawn"``).
        name: names it in messages (``"reader process 1"``).
        hint: what :class:`WorkerDied` tells the user to check.
        main: whether unpickling ``fn`` may need the main script (``False``: a spawned or forkserver worker
            does not import it again: :func:`~lmdbstore.util.procs.main_script_hidden`).
    """

    def __init__(self, fn: Any, method: str, name: str, *, hint: str | None = None, main: bool = True):
        ctx = mp.get_context(method)
        self.name, self.hint, self._ready = name, hint, False
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(_AtStart(fn), theirs, Lifeline.here(method)), daemon=True)  # type: ignore[attr-defined]
        try:
            with main_script_hidden(method) if not main else contextlib.nullcontext():
                self.proc.start()
        finally:
            theirs.close()  # the worker holds the only other end: its death closes the pipe
        self.fd = self._conn.fileno()
        self._queue: queue.SimpleQueue[Any] | None = None
        self._feeder: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def send(self, request: Any) -> None:
        """Send ``request`` (``None`` asks the worker to stop).

        Raises:
            WorkerDied: the worker is gone.
        """
        try:
            send(self.fd, request)
        except OSError:
            raise self.died() from None

    def send_later(self, request: Any) -> None:
        """Send ``request`` from a thread of this worker's (never blocks).  A request larger than the pipe's
        buffer, sent from the owner's own thread, could block while this worker blocks sending an answer the
        owner is not reading yet: the thread takes that wait instead."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._feeder = threading.Thread(target=self._feed, name="lmdbstore-worker-feeder", daemon=True)
            self._feeder.start()
        self._queue.put(request)

    def _feed(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not _CLOSE:
            try:
                send(self.fd, item)
            except OSError:  # the worker is gone; the owner notices as it waits for an answer
                return

    def ready(self) -> None:
        """Wait until the worker has loaded ``fn`` and run its ``start()``.

        Raises:
            WorkerDied: it ended first.
            Exception: what loading or starting raised there (see the module docstring).
        """
        if not self._ready:
            self._answer()
            self._ready = True

    def receive(self) -> Any:
        """The answer to the oldest request not yet answered (waits for it, watching the process).

        Raises:
            WorkerDied: the worker ended first.
            Exception: what ``fn`` raised for that request (see the module docstring).
        """
        self.ready()
        return self._answer()

    def _answer(self) -> Any:
        while not self._conn.poll():
            wait([self._conn, self.proc.sentinel])
            if self.proc.exitcode is not None and not self._conn.poll():
                raise self.died()
        try:
            ok, payload = receive(self.fd)
        except (EOFError, OSError):
            raise self.died() from None
        if not ok:
            raise _rebuilt(payload, self.name)
        return payload

    def died(self) -> WorkerDied:
        """The error for this worker having ended (reaped first)."""
        self.proc.join(TERMINATE_GRACE)
        return WorkerDied(
            f"{self.name} died (pid {self.proc.pid}, exit code {self.proc.exitcode})", self.proc.exitcode, self.hint
        )

    def close(self) -> None:
        """Close the pipe (after :func:`stop`: the feeder thread, if any, has nothing left to wait for)."""
        if self._conn.closed:
            return
        if self._queue is not None and self._feeder is not None:
            self._queue.put(_CLOSE)
            self._feeder.join(TERMINATE_GRACE)
        self._conn.close()


_CLOSE = object()


def stop(workers: Sequence[Worker], wait: float = STOP_SECONDS) -> None:
    """Ask ``workers`` to stop (``wait`` > 0: each finishes what it was sent, for up to ``wait`` seconds in all),
    terminate those still running, kill those still running :data:`TERMINATE_GRACE` later, reap them all and
    close their pipes.  Idempotent."""
    workers = [w for w in workers if not w._conn.closed]
    if wait > 0:
        for w in workers:
            with contextlib.suppress(OSError):  # already gone
                send(w.fd, None)
    deadline = time.monotonic() + wait
    for w in workers:
        w.proc.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.proc.is_alive():
            w.proc.terminate()
    for w in workers:
        w.proc.join(TERMINATE_GRACE)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.close()


def first_ready(workers: Sequence[Worker]) -> Worker:
    """The first of ``workers`` with an answer to read (waits for one).

    Raises:
        WorkerDied: one of them ended without answering.
    """
    conns = {w._conn: w for w in workers}
    ends = {w.proc.sentinel: w for w in workers}
    while True:
        ready = wait([*conns, *ends])
        for r in ready:
            if r in conns:
                return conns[r]  # type: ignore[index]
        for r in ready:
            if not ends[r]._conn.poll():  # type: ignore[index]
                raise ends[r].died()  # type: ignore[index]


# ---------------------------------------------------------------------------------------------- the pool
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
    ``workers=0`` runs ``fn`` in the calling process (same interface; for debugging and tests).
    """

    def __init__(self, fn: Callable[[Any], Any], workers: int, limit: int) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        self.fn, self.workers, self.limit = fn, workers, limit

    @property
    def private_results(self) -> bool:
        """Results are unpickled here from the workers' pipes (not with ``workers=0``: ``fn``'s own objects)."""
        return self.workers > 0

    def results(self, tasks: Sequence[Any], start: int = 0) -> Generator[tuple[int, Any], None, None]:
        """Yield ``(index, fn(tasks[index]))`` for ``index`` from ``start`` on, in order.

        At most ``limit`` tasks are submitted and not yet yielded, fewer where their results would take more
        memory than the machine can give (:class:`~lmdbstore.util.memory.ResultBudget`).  Leaving the generator
        for any reason (exhausted, an exception, ``close()``, KeyboardInterrupt) stops every worker.

        Raises:
            TaskFailure: ``fn`` raised for the task at the head of the order (or could not be loaded).
            WorkerDied: a worker ended unexpectedly.
        """
        if self.workers == 0:
            for i in range(start, len(tasks)):
                try:
                    out = self.fn(tasks[i])
                except Exception as exc:
                    raise TaskFailure(i, exc) from exc
                yield i, out
            return
        n = min(self.workers, len(tasks) - start)
        if n <= 0:
            return
        main = needs_main(self.fn)
        procs: list[Worker] = []
        finished = False
        try:
            for _ in range(n):
                procs.append(Worker(_Tasks(self.fn), "spawn", "a worker process", main=main))
            for w in procs:
                try:
                    w.ready()
                except WorkerDied:
                    raise
                except Exception as exc:
                    raise TaskFailure(LOAD_FAILED, exc) from exc
            yield from self._ordered(procs, tasks, start)
            finished = True
        finally:
            stop(procs, STOP_SECONDS if finished else 0)

    def _ordered(self, procs: list[Worker], tasks: Sequence[Any], start: int) -> Generator[tuple[int, Any], None, None]:
        sent: list[deque[int]] = [deque() for _ in procs]  # each worker's tasks not yet answered, in order
        nxt, head, ready = start, start, {}
        budget = ResultBudget(len(procs))
        while head < len(tasks):
            while nxt < len(tasks) and (nxt == head or nxt - head < budget.window(self.limit)):
                k = min(range(len(procs)), key=lambda k: len(sent[k]))  # the least busy worker takes it
                procs[k].send_later(pickled_task(tasks, nxt))
                sent[k].append(nxt)
                nxt += 1
            while head not in ready:
                w = first_ready(procs)
                index = sent[procs.index(w)].popleft()
                try:
                    ready[index] = (True, w.receive())
                except WorkerDied:
                    raise
                except Exception as exc:
                    ready[index] = (False, exc)
                budget.observe(ready[index][1])
            ok, out = ready.pop(head)
            if not ok:
                raise TaskFailure(head, out) from out
            yield head, out
            head += 1
