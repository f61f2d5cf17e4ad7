"""The child processes of ``test_signals.py``: what lmdbstore's reads do to the signal handlers of the program around
them (issue 34 #3-5).  Run as ``python signals_child.py MODE STORE N SEED [ARGS]`` (the store holds
``make_data(N, SEED)``); prints one JSON line.

``matrix PATH``: for every handler set-up the program may have -- none, faulthandler, its own C SIGBUS handler,
its own Python SIGBUS handler, its own SIGURG handler, asyncio's loop handler for SIGURG -- installed before the
first read and after it, reads random and block batches on the read path ``PATH`` (``offset``: by file offset, with
whichever copier this process has; ``lmdb``: through liblmdb) while a thread keeps opening ``data.mdb`` for writing
(each open breaks the read lease a batch holds).  Reports every batch that was not its samples, every call after
which SIGBUS's or SIGURG's disposition (handler, flags, mask) was not what it was before, and how often the
program's SIGURG handlers ran.

``fault FAULTHANDLER HANDLER``: reads on a thread (the compiled copier installs its SIGBUS handler while each copy
runs), sets up ``FAULTHANDLER`` (``off``, ``before``/``after`` the first read) and ``HANDLER`` (``none``, or
``exit``: a C handler, libc's ``_exit``, exiting 7), then -- while a long copy of the compiled copier runs on
another thread, its SIGBUS handler installed -- touches a page of its own map of a file it shrank: the process must
end as it would without lmdbstore (the copier's handler chains to the program's; never a loop), printing nothing.
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
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import make_data

from lmdbstore.store import copies
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
                r = StoreReader(store, positions=path == "offset")
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
    if copies.FAST is not None:  # a copy that runs ~0.1 s on a thread: the SIGBUS below comes while it runs
        src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
        zeros = np.zeros(1000, np.int64)
        started = threading.Event()

        def long_copy() -> None:
            started.set()
            while True:
                copies.FAST.copy(dst, zeros, src.ctypes.data, src.nbytes, zeros, 1 << 20)  # type: ignore[union-attr]

        threading.Thread(target=long_copy, daemon=True).start()
        started.wait()
        time.sleep(0.02)
    with tempfile.TemporaryFile() as f:  # the program's own map of a file that shrinks
        f.write(b"x" * 8192)
        f.flush()
        m = mmap.mmap(f.fileno(), 8192)
        f.truncate(0)
        print(m[5000])  # SIGBUS: the process ends here


def foreign(store: Path, x: np.ndarray, then: str) -> dict[str, Any]:
    """faulthandler enabled on this thread *while* a copy runs on another: the copier's handler is below
    faulthandler's then (which chains back to it), so the copier must not install itself over it again: it answers
    UNPROTECTED and reads go on without it, exactly; once faulthandler is disabled (putting the copier's back), it
    copies again and leaves SIGBUS's disposition as it first was.  ``then``: ``read`` (report), or ``fault`` (touch a
    page of a shrunk map of its own: the process must end, once, with faulthandler's report)."""
    fast = copies.FAST
    assert fast is not None
    r = StoreReader(store)
    b = np.arange(0, len(x), 7)
    pristine = disposition(signal.SIGBUS)
    src, dst, zeros = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8), np.zeros(300, np.int64)
    started = threading.Event()

    def long_copy() -> None:
        started.set()
        fast.copy(dst, zeros, src.ctypes.data, src.nbytes, zeros, 1 << 20)

    t = threading.Thread(target=long_copy)
    t.start()
    started.wait()
    faulthandler.enable()  # during the copy: over the copier's handler
    t.join()
    report: dict[str, Any] = {"unprotected": fast.copy(dst, zeros[:1], src.ctypes.data, 16, zeros[:1], 16)}
    report["read_ok"] = r.read_batch(b).tobytes() == x[b].tobytes()
    if then == "fault":
        with tempfile.TemporaryFile() as f:
            f.write(b"x" * 8192)
            f.flush()
            m = mmap.mmap(f.fileno(), 8192)
            f.truncate(0)
            print(m[5000])
    faulthandler.disable()  # puts back the handler it found: the copier's
    report["copied"] = fast.copy(dst, zeros[:1], src.ctypes.data, 16, zeros[:1], 16)
    report["read_ok_after"] = r.read_batch(b).tobytes() == x[b].tobytes()
    report["restored"] = disposition(signal.SIGBUS)[:8] == pristine[:8]
    return report


def dest(store: Path, x: np.ndarray) -> dict[str, Any]:
    """``read_batch(..., out=)`` into a map of a file that was truncated: the copy's *destination* faults.  The
    error must say so (not blame the store).  Without the compiled copier this runs with a SIGURG handler of the
    program's installed, so that no lease is taken and the kernel copies (numpy's copy under a lease would die
    of the SIGBUS, as any write into such memory does)."""
    if copies.FAST is None:
        signal.signal(signal.SIGURG, lambda *_: None)
    r = StoreReader(store)
    b = np.arange(0, 40)
    r.read_batch(b)  # warm: the batch is copied from the map, not read by preadv
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
