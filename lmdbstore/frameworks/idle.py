"""Reader processes that wait between passes and stop when no pass comes: what lets a feed keep its readers
across the epochs of a training (no start-up per epoch) and still leave nothing running for nobody when a
framework keeps the dataset for good (Keras on TensorFlow keeps every dataset it fitted on, and TensorFlow
the functions of a ``tf.data`` pipeline, for as long as the process lives).

A feed calls :meth:`IdleStop.rest` when a pass ends (its last batch handed out, Keras' ``on_epoch_end``)
and :meth:`IdleStop.wake` when one begins, both with its lock held.  Resting longer than
:func:`idle_seconds` -- at least :data:`IDLE_MIN_SECONDS`, and half the last pass's duration, so that a
validation pass between two epochs does not outlast it -- calls the owner's stop (the feed's ``close``:
readers stopped, shared memory freed; the next pass starts them again).  One thread per feed waits for
that (started at the first rest, not one per pass); it holds the feed weakly and ends when the feed is
collected.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["IDLE_MIN_SECONDS", "IDLE_PASS_SHARE", "IdleStop", "idle_seconds"]

#: Seconds readers wait at least for the next pass before they stop.
IDLE_MIN_SECONDS = 5.0
#: Share of the last pass's duration they wait, when longer than that.
IDLE_PASS_SHARE = 0.5


def idle_seconds(pass_seconds: float) -> float:
    """How long readers wait for the next pass after one of ``pass_seconds``."""
    return max(IDLE_MIN_SECONDS, IDLE_PASS_SHARE * pass_seconds)


class IdleStop:
    """Calls ``stop(owner)`` once the owner rests for :func:`idle_seconds` of its last pass without waking
    (see the module docstring).

    Args:
        owner: the feed (held weakly).
        stop: what stops it, called in this object's thread with ``lock`` held, and only if no pass began
            since :meth:`rest`.
        lock: the owner's (reentrant) lock around its passes; :meth:`wake` and :meth:`rest` are called with
            it held.
    """

    def __init__(self, owner: Any, stop: Callable[[Any], None], lock: AbstractContextManager[Any]):
        self._owner = weakref.ref(owner)
        self._stop, self._lock = stop, lock
        self._cond = threading.Condition(threading.Lock())
        self._deadline: float | None = None  # when to stop, while resting
        self._began = time.monotonic()
        self._passes = 0  # passes begun: the stop acts only if none began since it was decided
        self._thread: threading.Thread | None = None
        self._done = False
        weakref.finalize(owner, self._finish)

    def wake(self) -> None:
        """A pass begins: no stop."""
        with self._cond:
            self._passes += 1
            self._deadline = None
            self._began = time.monotonic()

    def rest(self) -> None:
        """The pass ended: stop unless another begins in time."""
        with self._cond:
            if self._deadline is not None or self._done:
                return  # already resting
            now = time.monotonic()
            self._deadline = now + idle_seconds(now - self._began)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmdbstore-idle-stop", daemon=True)
                self._thread.start()
            self._cond.notify()

    def cancel(self) -> None:
        """Forget a pending stop (the owner stops by itself)."""
        with self._cond:
            self._deadline = None

    def _finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def _due(self) -> int | None:
        """Wait until resting is over; the passes counted then, or ``None`` once the owner is gone."""
        with self._cond:
            while not self._done:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._deadline = None
                    return self._passes
                self._cond.wait(left)
            return None

    def _run(self) -> None:
        while True:
            passes = self._due()
            owner = self._owner()
            if passes is None or owner is None:
                return
            with self._lock:
                if passes == self._passes:  # no pass began since (wake runs under the same lock)
                    self._stop(owner)
            del owner
