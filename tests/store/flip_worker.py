"""Worker of the differential fuzz (``test_differential.py``): flips bytes of a store's ``samples`` B-tree one
at a time and, for each flip, reads every sample through the offset path and the same keys through liblmdb.

Run as ``python flip_worker.py STORE PLAN START`` (``PLAN``: an ``.npy`` of ``(offset, xor)`` rows, applied to
``STORE/data.mdb`` one at a time from row ``START``).  For every flip it prints two JSON lines, flushed: first
what the offset path did (``{"i": ..., "fast": "error" | "<sha1 of the bytes>", "why": ...}``), then what
liblmdb did (``{"i": ..., "lmdb": "error" | "<sha1>"}``), so that when liblmdb itself crashes the process the
caller still knows the offset path's answer.  The original byte is written back after each flip.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
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


def main() -> None:
    path, plan_file, start = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    plan = np.load(plan_file)
    with StoreReader(path) as r:
        m = r.meta
    n, spv, sb, trailer = m.count, m.samples_per_value, m.sample_bytes, m.trailer_bytes
    fd = os.open(path / "data.mdb", os.O_RDWR)
    try:
        for i in range(start, len(plan)):
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


if __name__ == "__main__":
    main()
