"""Reader processes that stop when nobody asks them for batches (a framework that keeps the dataset for good, a
loop that broke out of a pass): no batch asked for in :func:`idle_seconds` calls the feed's ``close`` from one
thread per feed; a pass stopped that way resumes at its next batch.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["IDLE_MIN_SECONDS", "IDLE_PASS_SHARE", "IdleStop", "idle_seconds"]

#: Seconds readers wait at least for the next batch asked for before they stop.
IDLE_MIN_SECONDS = 5.0
#: Share of the pass's duration they wait, when longer than that.
IDLE_PASS_SHARE = 0.5


def idle_seconds(pass_seconds: float) -> float:
    """How long readers wait for a batch to be asked for, after a pass (so far) of ``pass_seconds``."""
    return max(IDLE_MIN_SECONDS, IDLE_PASS_SHARE * pass_seconds)


class IdleStop:
    """Calls ``stop(owner)`` (the feed, held weakly) in a thread of its own, with ``lock`` (the owner's, around its
    passes) held, once no batch was asked for in :func:`idle_seconds` and nothing woke or touched it since."""

    def __init__(self, owner: Any, stop: Callable[[Any], None], lock: AbstractContextManager[Any]):
        self._owner = weakref.ref(owner)
        self._stop, self._lock = stop, lock
        self._cond = threading.Condition(threading.Lock())
        self._began = self._touched = time.monotonic()
        self._armed = False  # readers run: a stop may come
        self._resting: float | None = None  # when the pass ended (``None``: in a pass)
        self._thread: threading.Thread | None = None
        self._done = False
        weakref.finalize(owner, self._finish)

    def wake(self) -> None:
        """A pass begins (readers run)."""
        with self._cond:
            self._began = self._touched = time.monotonic()
            self._resting = None
            self._armed = True
            if self._thread is None and not self._done:
                self._thread = threading.Thread(target=self._run, name="lmdbstore-idle-stop", daemon=True)
                self._thread.start()
            self._cond.notify()

    def touch(self) -> None:
        """A batch was asked for (cheap: one clock read; the thread looks at it when its time comes)."""
        self._touched = time.monotonic()

    def rest(self) -> None:
        """The pass ended: stop unless another begins in time."""
        with self._cond:
            if self._resting is None:
                self._resting = time.monotonic()
                self._cond.notify()

    def cancel(self) -> None:
        """The owner stopped by itself: nothing to stop until the next :meth:`wake`."""
        with self._cond:
            self._armed = False

    def _finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def _deadline(self) -> float:
        if self._resting is not None:
            return self._resting + idle_seconds(self._resting - self._began)
        return self._touched + idle_seconds(self._touched - self._began)

    def _due(self) -> bool:
        """Wait until a stop is due (``True``) or the owner is gone (``False``)."""
        with self._cond:
            while not self._done:
                if not self._armed:
                    self._cond.wait()
                    continue
                left = self._deadline() - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
            return False

    def _run(self) -> None:
        while self._due():
            owner = self._owner()
            if owner is None:
                return
            with self._lock:  # the owner's lock first, as wake and rest are called under it
                with self._cond:
                    due = self._armed and self._deadline() <= time.monotonic()  # not woken or touched meanwhile
                    self._armed = not due and self._armed
                if due:
                    self._stop(owner)
            del owner
