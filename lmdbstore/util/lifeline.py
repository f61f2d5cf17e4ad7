"""Worker and reader processes that die with the process they serve, whatever kills it (``SIGKILL``,
``SIGTERM``, Ctrl-C, an exception): no process is left behind reading for nobody.

A :class:`Lifeline` is made in the owner before its workers start; :meth:`Lifeline.attach`, first thing in a
worker, ties the worker to the owner twice:

* ``PR_SET_PDEATHSIG`` (Linux): the kernel kills the worker when its parent *thread* ends, which is the owner's
  lifetime only for a worker forked from the main thread or a ``forkserver``; only then is it used (a worker
  forked from a ``tf.data`` generator thread must not die with that thread).
* a watchdog thread waiting for the owner to end, on a ``pidfd`` (Linux 5.3+) or by looking every
  :data:`POLL_SECONDS`; the owner is known by pid *and* start time (a reused pid is not it).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass

from lmdbstore.util.atomic import pid_alive

__all__ = ["POLL_SECONDS", "Lifeline", "process_alive", "process_start_time"]

#: How often the watchdog looks at the owner where no pidfd can wait for it.
POLL_SECONDS = 1.0
#: ``prctl`` option number (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), or ``None`` when it does not run
    (gone, or a zombie) or ``/proc`` is not there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    return int(fields[19])


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` runs and, when ``start`` is given, is the one that started then."""
    if start is not None:
        return process_start_time(pid) == start
    return pid_alive(pid)


def _set_parent_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in this process; whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(pid: int, start: int | None) -> None:
    """Wait for process ``pid`` to end, then end this process at once."""
    fd = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)  # type: ignore[attr-defined,unused-ignore]
    if fd is not None and process_alive(pid, start):  # the pidfd is the owner's, not a reused pid's
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
    else:
        while process_alive(pid, start):
            time.sleep(POLL_SECONDS)
    os._exit(1)


@dataclass(frozen=True)
class Lifeline:
    """Ties a worker to its owner process ``owner`` (pid) started at ``owner_start`` (``None`` without ``/proc``);
    ``parent_death``: whether the worker may use ``PR_SET_PDEATHSIG``.  Made by :meth:`here` in the owner."""

    owner: int
    owner_start: int | None
    parent_death: bool

    @classmethod
    def here(cls, method: str | None) -> Lifeline:
        """The lifeline of workers this thread is about to start by ``method`` (``None``: the platform's)."""
        import multiprocessing as mp

        method = method or mp.get_start_method()
        main = threading.current_thread() is threading.main_thread()
        return cls(os.getpid(), process_start_time(os.getpid()), method == "forkserver" or main)

    def attach(self) -> None:
        """In the worker: die with the owner from now on (and at once if it is already gone)."""
        if os.getpid() == self.owner:
            return  # not a worker: the owner itself (no processes)
        if self.parent_death:
            _set_parent_death_signal()
        if not process_alive(self.owner, self.owner_start):  # it died before the signal was set
            os._exit(1)
        threading.Thread(
            target=_watch, args=(self.owner, self.owner_start), name="lmdbstore-lifeline", daemon=True
        ).start()
