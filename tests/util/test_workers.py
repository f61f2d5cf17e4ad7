"""Worker processes (lmdbstore.util.workers) on their own: answers in turn, errors raised as themselves, a death
in one line, a descriptor passed to them, and their stop.  Real worker processes throughout."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import signal
import time
from pathlib import Path

import parallel_tasks as pt
import pytest

from lmdbstore.errors import LmdbStoreError
from lmdbstore.util.workers import PassedFd, RemoteTraceback, WorkerDied, Workers


def test_workers_answer_in_turn_raise_as_themselves_die_in_one_line_and_stop_at_once() -> None:
    w = Workers(abs, 2, "spawn", "test worker {}", main=False)
    for request in (-3, "x", -4):  # abs("x") raises in worker 1: a TypeError here, its traceback the cause
        w.send(request)
    assert w.pending == 3 and w.answer() == 3
    with pytest.raises(TypeError, match="bad operand") as err:
        w.answer()
    assert isinstance(err.value.__cause__, RemoteTraceback) and "Traceback" in str(err.value.__cause__)
    assert "(raised in test worker 1)" in err.value.__notes__
    assert w.answer() == 4  # the workers go on after an error
    procs = w.procs
    w.close()
    assert len(procs) == 2 and not any(p.is_alive() for p in procs) and not w.procs

    slow = Workers(time.sleep, 1, "spawn", "a test worker", main=False)
    slow.send(60)
    pid = slow.procs[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=r"^a test worker died \(pid \d+, exit code -9\)$") as died:
        slow.answer()
    assert died.value.exitcode == -9
    slow.close()

    busy = Workers(time.sleep, 1, "spawn", "a test worker", main=False)
    busy.send(60)
    pid = busy.procs[0].pid
    t0 = time.monotonic()
    busy.close(0)  # terminated at once, and reaped
    assert time.monotonic() - t0 < 5 and not os.path.exists(f"/proc/{pid}")
    busy.close()  # idempotent


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_passed_descriptor_is_the_file_the_owner_opened(tmp_path: Path, method: str) -> None:
    """The worker reads the file the owner holds open, even once the path names another file (rm && cp)."""
    path = tmp_path / "data"
    path.write_bytes(b"first file")
    fd = os.open(path, os.O_RDONLY)
    try:
        path.unlink()
        path.write_bytes(b"other file")
        w = Workers(functools.partial(pt.read_passed, PassedFd(fd)), 1, method, "a test worker")
        w.send(10)
        assert w.answer() == b"first file"
        w.close()
        with pytest.raises(TypeError, match="only to a worker process as it starts"):
            pickle.dumps(PassedFd(fd))  # anywhere else, multiprocessing would start a server thread for good
    finally:
        os.close(fd)


def test_what_cannot_travel_is_one_line_naming_its_type_and_a_worker_that_cannot_start_raises_here() -> None:
    w = Workers(pt.raise_unpicklable, 1, "spawn", "a test worker")
    w.send(1)
    with pytest.raises(LmdbStoreError, match="a test worker failed: Unsendable: cannot travel") as err:
        w.answer()
    assert "raise_unpicklable" in str(err.value.__cause__)
    w.close()
    with pytest.raises(ValueError, match="cannot start"):  # the function's start() raised in the worker
        Workers(pt.FailsToStart(), 2, "spawn", "a test worker")
    assert not [p for p in mp.active_children() if "resource_tracker" not in p.name]
