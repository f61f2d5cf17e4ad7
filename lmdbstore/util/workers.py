"""Worker processes: the one way lmdbstore starts, talks to, watches and stops them (the ingest and
``write_parallel`` pool, the feed's readers, ``verify``'s value pass and page walk).

:class:`Workers` are ``n`` processes started by a named method (:func:`~lmdbstore.util.procs.start_method`),
each calling one function on the requests it is sent and answering them in order:

* **Start**: the function is pickled as a process starts (so its :class:`PassedFd` descriptors travel) and
  unpickled by the worker (an import failure is raised here); its optional ``start()`` runs first.  Workers
  ignore Ctrl-C and die with the owner whatever kills it (:class:`~lmdbstore.util.lifeline.Lifeline`).
* **Transport**: one pipe per worker, pickles with numpy data out of band, read into uninitialized buffers (a
  ``/dev/shm`` file per answer cost more).  No lock or semaphore for the resource tracker to warn about.
* **Failures**: what the function raised is raised here as itself (else a one-line
  :class:`~lmdbstore.errors.LmdbStoreError` naming its type), the worker's traceback its cause
  (:class:`RemoteTraceback`); a worker that ends without answering is a :class:`WorkerDied` (pid, exit code).
* **Stop**: workers finish what they were sent, are terminated after the time given, killed
  :data:`TERMINATE_GRACE` later, and reaped.

Not ``ProcessPoolExecutor``: before Python 3.14 it cannot stop a running call at once, and a descriptor reaches
its workers only through an initializer's global.
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
import weakref
from multiprocessing.connection import wait
from typing import Any

import numpy as np

from lmdbstore.errors import LmdbStoreError
from lmdbstore.util.lifeline import Lifeline
from lmdbstore.util.procs import main_script_hidden

__all__ = [
    "STOP_SECONDS",
    "TERMINATE_GRACE",
    "PassedFd",
    "RemoteTraceback",
    "remote_traceback",
    "WorkerDied",
    "Workers",
]

#: Seconds a worker asked to stop gets to finish what it was sent before it is terminated.
STOP_SECONDS = 5.0
#: Seconds a terminated worker gets to exit before it is killed.
TERMINATE_GRACE = 2.0


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
        from multiprocessing import context, reduction

        if context.get_spawning_popen() is None:  # elsewhere DupFd would start a server thread for good
            raise TypeError("a descriptor is sent only to a worker process as it starts")
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> PassedFd:
    return PassedFd(dup.detach())


# ---------------------------------------------------------------------------------------------- the workers
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


class _Worker:
    """One worker process and its pipe (the owner's end); a thread of its own sends what :meth:`send_later` is
    given."""

    def __init__(self, fn: Any, method: str, name: str, hint: str | None):
        ctx = mp.get_context(method)
        self.name, self.hint = name, hint
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(_AtStart(fn), theirs, Lifeline.here(method)), daemon=True)  # type: ignore[attr-defined]
        try:
            self.proc.start()
        finally:
            theirs.close()  # the worker holds the only other end: its death closes the pipe
        self.fd = self.conn.fileno()
        self.queue: queue.SimpleQueue[Any] | None = None
        self.feeder: threading.Thread | None = None

    def send(self, request: Any) -> None:
        try:
            send(self.fd, request)
        except OSError:
            raise self.died() from None

    def send_later(self, request: Any) -> None:
        if self.queue is None:
            self.queue = queue.SimpleQueue()
            self.feeder = threading.Thread(target=self._feed, name="lmdbstore-worker-feeder", daemon=True)
            self.feeder.start()
        self.queue.put(request)

    def _feed(self) -> None:
        assert self.queue is not None
        while (item := self.queue.get()) is not _CLOSE:
            try:
                send(self.fd, item)
            except OSError:  # the worker is gone; the owner notices as it waits for an answer
                return

    def answer(self) -> Any:
        """The next answer (waits for it, watching the process); a failure is raised (see the module docstring)."""
        while not self.conn.poll():
            wait([self.conn, self.proc.sentinel])
            if self.proc.exitcode is not None and not self.conn.poll():
                raise self.died()
        try:
            ok, payload = receive(self.fd)
        except (EOFError, OSError):
            raise self.died() from None
        if not ok:
            raise _rebuilt(payload, self.name)
        return payload

    def died(self) -> WorkerDied:
        self.proc.join(TERMINATE_GRACE)
        code = self.proc.exitcode
        return WorkerDied(f"{self.name} died (pid {self.proc.pid}, exit code {code})", code, self.hint)

    def close(self) -> None:
        if self.queue is not None and self.feeder is not None:
            self.queue.put(_CLOSE)
            self.feeder.join(TERMINATE_GRACE)
        self.conn.close()


_CLOSE = object()


def _stop(workers: list[_Worker], wait: float) -> None:
    """Ask ``workers`` to stop (``wait`` > 0: each finishes what it was sent, for up to ``wait`` seconds in all),
    terminate those still running, kill those still running :data:`TERMINATE_GRACE` later, reap them all and
    close their pipes; an idempotent finalizer."""
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
    workers.clear()


class Workers:
    """``n`` (at least 1) worker processes started by ``method`` calling ``fn``: request ``k`` goes to worker
    ``k % n``, answers come back in request order.  Stopped by :meth:`close` or when collected.

    Args:
        fn: picklable (a module-level function, or an object with ``__call__`` and optionally ``start()`` and
            ``close()``, run first and last in each worker).
        name, hint: names worker ``k`` in messages (formatted with ``k``); what :class:`WorkerDied` says to check.
        main: whether unpickling ``fn`` may need the main script (``False``:
            :func:`~lmdbstore.util.procs.main_script_hidden`).

    Raises:
        WorkerDied: a worker ended before it was ready.
        Exception: what loading ``fn`` or its ``start()`` raised in a worker.
    """

    def __init__(self, fn: Any, n: int, method: str, name: str, *, hint: str | None = None, main: bool = True):
        self.method = method
        self._workers: list[_Worker] = []
        self._stopper = weakref.finalize(self, _stop, self._workers, STOP_SECONDS)
        self.sent = self.answered = 0
        try:
            with main_script_hidden(method) if not main else contextlib.nullcontext():
                for k in range(n):
                    self._workers.append(_Worker(fn, method, name.format(k), hint))
            for w in self._workers:
                w.answer()  # ready
        except BaseException:
            self.close(0)
            raise

    @property
    def procs(self) -> list[Any]:
        """The processes (``multiprocessing.Process``)."""
        return [w.proc for w in self._workers]

    @property
    def pending(self) -> int:
        """Requests sent and not yet answered."""
        return self.sent - self.answered

    def send(self, request: Any, later: bool = False) -> None:
        """Send the next request (``later``: from the worker's own sending thread, never blocking: a request larger
        than the pipe's buffer could otherwise wait for a worker that waits to send an answer not read yet).

        Raises:
            WorkerDied: its worker is gone.
        """
        w = self._workers[self.sent % len(self._workers)]
        w.send_later(request) if later else w.send(request)
        self.sent += 1

    def answer(self) -> Any:
        """The answer to the oldest request not yet answered (waits for it, watching the process).

        Raises:
            WorkerDied: its worker ended first.
            Exception: what ``fn`` raised for it, as itself, the worker's traceback its cause.
        """
        w = self._workers[self.answered % len(self._workers)]
        self.answered += 1
        return w.answer()

    def drop(self) -> None:
        """Wait out the requests not yet answered and forget their answers (and errors).

        Raises:
            WorkerDied: a worker ended first.
        """
        while self.pending:
            try:
                self.answer()
            except WorkerDied:
                raise
            except Exception:  # the error of an answer nobody asks for any more
                pass

    def close(self, wait: float = STOP_SECONDS) -> None:
        """Stop the workers (see :func:`_stop`; ``wait=0``: terminate them at once); idempotent."""
        if self._stopper.detach() is not None:
            _stop(self._workers, wait)
