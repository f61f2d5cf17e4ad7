"""The child processes of ``test_signals.py``: what lmdbstore's reads do to the signal handlers of the program around
them (issue 34 #3-5).  Run as ``python signals_child.py MODE STORE N SEED [ARGS]`` (the store holds
``make_data(N, SEED)``); prints one JSON line.

``matrix PATH``: for every handler set-up the program may have -- none, faulthandler, its own C SIGBUS handler,
its own Python SIGBUS handler, its own SIGURG handler, asyncio's loop handler for SIGURG -- installed before the
first read and after it, reads random and block batches on the read path ``PATH`` (``compiled``: by file offset with
the compiled reader; ``preadv``: by file offset without it; ``lmdb``: through liblmdb) while a thread keeps opening
``data.mdb`` for writing.  Reports every batch that was not its samples, every call after which SIGBUS's or SIGURG's
disposition (handler, flags, mask) was not what it was before, and how often the program's SIGURG handlers ran.

``fault FAULTHANDLER HANDLER``: reads on a thread (the compiled reader installs its SIGBUS handler while each batch
runs), sets up ``FAULTHANDLER`` (``off``, ``before``/``after`` the first read) and ``HANDLER`` (``none``, or
``exit``: a C handler, libc's ``_exit``, exiting 7), then -- while a guard of liblmdb's reads is held on another
thread, the reader's SIGBUS handler installed -- touches a page of its own map of a file it shrank: the process must
end as it would without lmdbstore (the reader's handler chains to the program's; never a loop), printing nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import json
import mmap
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import make_data

from lmdbstore.store import fileread
from lmdbstore.store.reader import StoreReader

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
#: Room for libc's ``struct sigaction`` (152 bytes on x86-64 glibc); its first member is the handler.
SIGACTION_BYTES = 512
WATCHED = (signal.SIGBUS, signal.SIGURG)


def disposition(sig: int) -> bytes:
    """The C-level disposition of ``sig``: its handler, the signals it blocks and its flags (libc's ``struct
    sigaction`` on x86-64/aarch64: the handler at 0, the mask from 8 -- the kernel's 64 signals, libc leaves the
    rest of its 128 bytes undefined --, the flags at 136)."""
    buf = ctypes.create_string_buffer(SIGACTION_BYTES)
    assert LIBC.sigaction(sig, None, buf) == 0
    raw = buf.raw
    return raw[:16] + raw[136:140]


def dispositions() -> dict[int, bytes]:
    return {sig: disposition(sig) for sig in WATCHED}


def set_disposition(sig: int, raw: bytes) -> None:
    buf = ctypes.create_string_buffer(raw, SIGACTION_BYTES)
    assert LIBC.sigaction(sig, buf, None) == 0


def exit_handler(sig: int) -> None:
    """A C SIGBUS handler of the program's: libc's ``_exit`` (the process exits with the signal's number)."""
    raw = bytearray(SIGACTION_BYTES)
    raw[:8] = ctypes.cast(LIBC._exit, ctypes.c_void_p).value.to_bytes(8, sys.byteorder)  # type: ignore[union-attr]
    set_disposition(sig, bytes(raw))


class Breaker:
    """A thread that keeps opening ``data.mdb`` for writing: each open breaks the read lease a batch holds (the
    kernel then signals this process) and waits until the batch gives it back."""

    def __init__(self, data: Path) -> None:
        self.data, self.stop, self.opens = data, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(0.001):
            fd = os.open(self.data, os.O_WRONLY)
            os.close(fd)
            self.opens += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def batches(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    start = int(rng.integers(0, n - 200))
    return [rng.integers(0, n, 256), np.arange(start, start + 200)]


def matrix(store: Path, x: np.ndarray, path: str) -> dict[str, Any]:
    calls = {"urg": 0}
    loop = asyncio.new_event_loop()

    def on_urg(*_: Any) -> None:
        calls["urg"] += 1

    def py_bus(*_: Any) -> None:
        raise AssertionError("the program's SIGBUS handler ran")

    setups = {
        "none": lambda: None,
        "faulthandler": faulthandler.enable,
        "sigbus-c": lambda: exit_handler(signal.SIGBUS),
        "sigbus-py": lambda: signal.signal(signal.SIGBUS, py_bus),
        "sigurg": lambda: signal.signal(signal.SIGURG, on_urg),
        "asyncio": lambda: loop.add_signal_handler(signal.SIGURG, on_urg),
    }
    report: dict[str, Any] = {"wrong": [], "changed": [], "urg_calls": {}, "opens": 0, "reads": 0}
    rng = np.random.default_rng(5)
    breaker = Breaker(store / "data.mdb")
    try:
        for name, setup in setups.items():
            for when in ("before", "after"):
                calls["urg"] = 0
                if when == "before":
                    setup()
                r = StoreReader(store, positions=path != "lmdb")
                for i in range(12):
                    if when == "after" and i == 1:
                        setup()
                    for b in batches(len(x), rng):
                        before = dispositions()
                        got = r.read_batch(b)
                        after = dispositions()
                        report["reads"] += 1
                        if got.tobytes() != x[b].tobytes():
                            report["wrong"].append(f"{name}/{when}")
                        if after != before:
                            report["changed"].append(f"{name}/{when}: {[s for s in WATCHED if after[s] != before[s]]}")
                r.close()
                loop.run_until_complete(asyncio.sleep(0.01))  # asyncio's callbacks run in the loop
                report["urg_calls"][f"{name}/{when}"] = calls["urg"]
                if name == "asyncio":
                    loop.remove_signal_handler(signal.SIGURG)
                if name == "faulthandler":
                    faulthandler.disable()
                for sig in WATCHED:  # the defaults again, in Python's table too
                    signal.signal(sig, signal.SIG_DFL)
                assert all(raw[:8] == bytes(8) for raw in dispositions().values())  # SIG_DFL
    finally:
        breaker.close()
    report["opens"] = breaker.opens
    return report


def fault(store: Path, x: np.ndarray, when: str, handler: str) -> None:
    r = StoreReader(store)
    stop = threading.Event()

    def read() -> None:  # copies on a thread: the SIGBUS below may come while the copier's handler is installed
        rng = np.random.default_rng(1)
        while not stop.is_set():
            b = rng.integers(0, len(x), 256)
            assert r.read_batch(b).tobytes() == x[b].tobytes()

    if when == "before":
        faulthandler.enable()
    r.read_batch(np.arange(10))
    if when == "after":
        faulthandler.enable()
    if handler == "exit":
        exit_handler(signal.SIGBUS)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    r.read_batch(np.arange(20, 40))
    if fileread.COMPILED is not None:  # a guard held on a thread: the SIGBUS below comes while it is installed
        guard(fileread.COMPILED, threading.Event())
    with tempfile.TemporaryFile() as f:  # the program's own map of a file that shrinks
        f.write(b"x" * 8192)
        f.flush()
        m = mmap.mmap(f.fileno(), 8192)
        f.truncate(0)
        print(m[5000])  # SIGBUS: the process ends here


def guard(c: Any, release: threading.Event) -> threading.Thread:
    """A thread that holds a guard of liblmdb's reads (of a map of nothing) until ``release``: the reader's SIGBUS
    handler is installed meanwhile."""
    held = threading.Event()

    def hold() -> None:
        assert c.lmdb_begin(np.zeros(2, np.uint64))
        held.set()
        release.wait()
        c.lmdb_end(-1)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    held.wait()
    return t


def foreign(store: Path, x: np.ndarray, then: str) -> dict[str, Any]:
    """faulthandler enabled on this thread *while* a guard runs on another: the reader's handler is below
    faulthandler's then (which chains back to it), so the reader must not install itself over it again: guards
    answer unprotected and batches are read without copies from the map, exactly; once faulthandler is disabled
    (putting the reader's back), it guards again and leaves SIGBUS's disposition as it first was.  ``then``: ``read``
    (report), or ``fault`` (touch a page of a shrunk map of its own: the process must end, once, with faulthandler's
    report)."""
    c = fileread.COMPILED
    assert c is not None
    r = StoreReader(store)
    b = np.arange(0, len(x), 7)
    pristine = disposition(signal.SIGBUS)
    release = threading.Event()
    t = guard(c, release)
    faulthandler.enable()  # during the guard: over the reader's handler
    release.set()
    t.join()
    report: dict[str, Any] = {"unprotected": not c.lmdb_begin(np.zeros(2, np.uint64))}
    report["read_ok"] = all(r.read_batch(b).tobytes() == x[b].tobytes() for _ in range(3))
    if then == "fault":
        with tempfile.TemporaryFile() as f:
            f.write(b"x" * 8192)
            f.flush()
            m = mmap.mmap(f.fileno(), 8192)
            f.truncate(0)
            print(m[5000])
    faulthandler.disable()  # puts back the handler it found: the reader's
    report["guarded"] = bool(c.lmdb_begin(np.zeros(2, np.uint64)))
    c.lmdb_end(-1)
    report["read_ok_after"] = r.read_batch(b).tobytes() == x[b].tobytes()
    report["restored"] = disposition(signal.SIGBUS)[:8] == pristine[:8]
    return report


def dest(store: Path, x: np.ndarray) -> dict[str, Any]:
    """``read_batch(..., out=)`` into a map of a file that was truncated: the batch's *destination* faults (a copy
    from the map: SIGBUS; a read: EFAULT).  The error must say so (not blame the store)."""
    r = StoreReader(store)
    b = np.arange(0, 40)
    for _ in range(4):
        r.read_batch(b)  # warm: the batch is copied from the map once the page map is trusted
    with tempfile.TemporaryFile() as f:
        f.truncate(x[b].nbytes)
        m = mmap.mmap(f.fileno(), x[b].nbytes)
        out = np.frombuffer(m, x.dtype).reshape(x[b].shape)
        f.truncate(0)  # every page of out is gone
        try:
            r.read_batch(b, out=out)
        except Exception as exc:
            return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def main() -> None:
    mode, store, n, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if os.environ.get("READ_ROUTE") == "preadv":
        fileread.COMPILED = None
    x, _ = make_data(n, seed)
    if mode == "matrix":
        print(json.dumps(matrix(store, x, sys.argv[5])))
    elif mode == "dest":
        print(json.dumps(dest(store, x)))
    elif mode == "foreign":
        print(json.dumps(foreign(store, x, sys.argv[5])))
    else:
        fault(store, x, sys.argv[5], sys.argv[6])
        print(json.dumps({"survived": True}))


if __name__ == "__main__":
    main()
