"""Worker of the differential fuzz (``test_differential.py``): flips bytes of a store's ``samples`` B-tree one
at a time and, for each flip, reads every sample through the offset path and the same keys through liblmdb.

Run as ``python flip_worker.py STORE PLAN`` (``PLAN``: an ``.npy`` of ``(offset, xor)`` rows, applied to
``STORE/data.mdb`` one at a time).  For every flip it prints two JSON lines, flushed: first what the offset path
did (``{"i": ..., "fast": "error" | "<sha1 of the bytes>", "why": ...}``), then what liblmdb did
(``{"i": ..., "lmdb": "error" | "<sha1>"}``).  The original byte is written back after each flip.

The flips run in a forked child of this process (no environment is open at the fork): when liblmdb crashes it on
a damaged page, this process writes the pristine file back, prints ``{"i": ..., "crash": <signal>}`` for the
flip it was on (whose offset-path line was printed first) and forks the next child at the flip after it; an
interpreter's start and imports once, not once per crash (~30 crashes in 1,100 flips).  A child that ends with a
non-zero status without a signal ends this process with that status.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import traceback
from pathlib import Path

import lmdb
import numpy as np

from lmdbstore.errors import LmdbStoreError
from lmdbstore.format.layout import DB_SAMPLES, MAX_DBS, encode_key
from lmdbstore.store.reader import StoreReader


def digest(b: bytes) -> str:
    return hashlib.sha1(b).hexdigest()


def fast_read(path: Path, n: int) -> tuple[str, str]:
    """Every sample through the default reader (offset path): its digest, or ``"error"`` and why."""
    r = StoreReader(path)
    try:
        return digest(r.read_batch(np.arange(n)).tobytes()), ""
    except LmdbStoreError as exc:
        return "error", str(exc)[:160]
    finally:
        r.close()


def lmdb_read(path: Path, n: int, spv: int, sb: int, trailer: int) -> str:
    """The same samples through liblmdb lookups of their keys (no offset table, no lmdbstore checks)."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=MAX_DBS, readahead=False)
    try:
        with env.begin(buffers=True) as txn:
            db = env.open_db(DB_SAMPLES, txn=txn, create=False)
            out = bytearray()
            for first in range(0, n, spv):
                v = txn.get(encode_key(first), db=db)
                k = min(spv, n - first)
                if v is None or len(v) != k * sb + trailer:
                    return "error"
                out += bytes(v[: k * sb])
            return digest(bytes(out))
    except lmdb.Error:
        return "error"
    finally:
        env.close()


def flips(path: Path, plan: np.ndarray, start: int, at: mmap.mmap, n: int, spv: int, sb: int, trailer: int) -> None:
    """Apply ``plan``'s flips from row ``start`` (each one's row written to ``at`` first) and print both reads."""
    fd = os.open(path / "data.mdb", os.O_RDWR)
    try:
        for i in range(start, len(plan)):
            at[:8] = i.to_bytes(8, "little")
            off, xor = int(plan[i, 0]), int(plan[i, 1])
            orig = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([orig[0] ^ xor]), off)
            try:
                fast, why = fast_read(path, n)
                print(json.dumps({"i": i, "fast": fast, "why": why}), flush=True)
                print(json.dumps({"i": i, "lmdb": lmdb_read(path, n, spv, sb, trailer)}), flush=True)
            finally:
                os.pwrite(fd, orig, off)
    finally:
        os.close(fd)


def main() -> None:
    path, plan = Path(sys.argv[1]), np.load(sys.argv[2])
    with StoreReader(path) as r:
        m = r.meta
    pristine = (path / "data.mdb").read_bytes()
    at = mmap.mmap(-1, 8)  # the row the child is on, shared with it
    start = 0
    while start < len(plan):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                flips(path, plan, start, at, m.count, m.samples_per_value, m.sample_bytes, m.trailer_bytes)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if not os.WIFSIGNALED(status):
            if os.waitstatus_to_exitcode(status) != 0:
                sys.exit(os.waitstatus_to_exitcode(status))
            break
        crashed = int.from_bytes(at[:8], "little")
        print(json.dumps({"i": crashed, "crash": os.WTERMSIG(status)}), flush=True)
        (path / "data.mdb").write_bytes(pristine)
        start = crashed + 1


if __name__ == "__main__":
    main()
