"""One function call in a process of its own, started now and answered later: work that overlaps the caller's.

:class:`BackgroundCall` spawns a process running ``fn(arg)`` (``fn`` module-level, ``arg`` and the result
picklable) and returns at once; :meth:`~BackgroundCall.result` waits for the answer.  The process ignores
Ctrl-C (the caller decides), dies with the caller whatever kills it (:class:`~lmdbstore.util.lifeline.Lifeline`),
and is ended by :meth:`~BackgroundCall.close` (or leaving the ``with`` block) however the caller's work ends,
so nothing is left running after the call that needed it.  ``verify`` walks the LMDB page structure this way
while its workers read the values.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable
from typing import Any

from lmdbstore.util.lifeline import Lifeline
from lmdbstore.util.workers import TERMINATE_GRACE, TaskFailure, WorkerDied, _failure, _rebuilt

__all__ = ["BackgroundCall"]

#: How often (seconds) a waiting caller checks that the process is still alive.
POLL_SECONDS = 0.2


def _main(fn: Callable[[Any], Any], arg: Any, conn: Any, lifeline: Lifeline) -> None:
    """In the process: run ``fn(arg)`` and send ``(ok, result or (type, message, traceback))``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lifeline.attach()
    try:
        out: tuple[bool, Any] = (True, fn(arg))
    except BaseException as exc:
        out = (False, _failure(exc))
    conn.send(out)
    conn.close()


class BackgroundCall:
    """``fn(arg)`` in a spawned process (see the module docstring).

    Raises (from :meth:`result`):
        TaskFailure: ``fn`` raised (its type name, message and traceback text).
        WorkerDied: the process ended without answering (killed, out of memory).
    """

    def __init__(self, fn: Callable[[Any], Any], arg: Any):
        ctx = mp.get_context("spawn")
        self._rx, tx = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_main, args=(fn, arg, tx, Lifeline.here("spawn")), daemon=True)
        self._proc.start()
        tx.close()  # the process holds the only write end: its death closes the pipe
        self._done = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def result(self) -> Any:
        """Wait for ``fn(arg)`` and return it; the process is reaped either way."""
        try:
            while not self._rx.poll(POLL_SECONDS):
                if self._proc.exitcode is not None and not self._rx.poll(0):
                    raise WorkerDied("a background process died", self._proc.exitcode)
            try:
                ok, payload = self._rx.recv()
            except EOFError:
                self._proc.join(TERMINATE_GRACE)
                raise WorkerDied("a background process died", self._proc.exitcode) from None
        finally:
            self.close()
        if not ok:
            raise TaskFailure(0, _rebuilt(payload, "a background process"))
        return payload

    def close(self) -> None:
        """End the process if it still runs (terminate, then kill) and reap it; idempotent."""
        if self._done:
            return
        self._done = True
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(TERMINATE_GRACE)
            if self._proc.is_alive():
                self._proc.kill()
        self._proc.join()
        self._rx.close()

    def __enter__(self) -> BackgroundCall:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
