"""When a reader's snapshot is still the file's: the one rule every read of a store follows.

A read transaction sees the snapshot of the last commit when it began, transaction id ``S``.  liblmdb keeps
that snapshot's pages from reuse only while the transaction is *registered* in the reader table
(``lock=True``) and alive.  Otherwise -- a lock-free reader (``lock=False``), or a registered transaction that
something ended (py-lmdb's ``set_mapsize`` and ``close`` end every transaction of an environment) -- a
writer may overwrite the snapshot's pages, and any read from them, by offset or through liblmdb, may return
another commit's bytes.  When it may, is LMDB's free-page rule (``mdb_page_alloc`` and ``mdb_find_oldest`` in
``mdb.c``): a write transaction ``T`` reuses the pages freed by transactions ``< oldest``, where ``oldest`` is
``T - 1`` or the oldest registered reader.  The pages of snapshot ``S`` are freed by ``S + 1`` at the
earliest, so the first writer that may overwrite them is ``S + 3``; ``S + 3`` begins only after ``S + 2``
committed, and a commit writes its data pages before its meta page, which for ``S + 2`` is meta page
``S & 1`` (LMDB alternates), the page describing ``S`` itself.  Hence the rule (:meth:`Snapshot.protected`):

    the snapshot is protected iff its transaction is registered and alive, or meta page ``S & 1`` still
    holds exactly the bytes it held when the transaction began.

Checked *after* a read, a protected answer proves the bytes read were ``S``'s: no writer that could
overwrite them had begun.  A data file whose meta pages this parser does not recognise falls back to LMDB's own
view of the latest commit (``env.info()``) with the same ``S + 1`` bound.

The rule protects a snapshot from a writer, not from another file: a data file rewritten in place (``cp`` of
another store over ``data.mdb``) can hold a byte-identical meta page (two stores written the same way) and
under a registered transaction nothing looks at the file at all.  So every check also compares the snapshot's
*record fingerprint* (:attr:`Snapshot.record`): the bytes of the metadata record from its ``store_id`` on (the
store's random id, the last commit's time and the exact value statistics, ~250 bytes), read where the record
lies in the file (found once per snapshot by walking the ``meta`` B-tree, and checked against liblmdb's bytes).  Those bytes are the snapshot's own while it is
protected, so a difference means another file.  A check is one 152-byte ``pread`` and one of the fingerprint
for a lock-free reader, the fingerprint's alone for a registered one (~0.5 us each).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from lmdbstore.format.pages import META_BYTES, LmdbMeta, UnsupportedLayout, read_meta_page

__all__ = ["FINGERPRINT_BYTES", "Snapshot", "capture", "fingerprint", "txn_alive"]

#: Bytes of the metadata record a check compares (from its ``store_id`` on: see the module docstring).
FINGERPRINT_BYTES = 256
#: Where the fingerprint starts in the metadata JSON (its keys are sorted: ``store_id`` comes near the end).
FINGERPRINT_KEY = b'"store_id": "'


def txn_alive(txn: Any) -> bool:
    """Whether the py-lmdb transaction ``txn`` is still open (``set_mapsize``/``close`` end them silently)."""
    if txn is None:
        return False
    try:
        txn.id()
    except lmdb.Error:
        return False
    return True


@dataclass(frozen=True)
class Snapshot:
    """A read transaction's snapshot: its id, whether it is registered, and its meta page as it was.

    ``meta`` is ``None`` when the data file's layout is unknown (``known_layout`` false) or when the meta
    page had already been overwritten by the time it was read (a writer committed twice meanwhile).
    ``record``: the file offset and bytes of the metadata record's fingerprint in this snapshot (see the module
    docstring; ``None`` until the metadata was read, or where liblmdb's map does not show where it lies).
    """

    txnid: int
    registered: bool
    meta: LmdbMeta | None
    known_layout: bool = True
    record: tuple[int, bytes] | None = None

    @property
    def needed_bytes(self) -> int:
        """Bytes the data file must have for this snapshot's pages (0 when unknown)."""
        return (self.meta.last_pg + 1) * self.meta.psize if self.meta is not None else 0

    def intact(self, fd: int) -> bool:
        """Whether meta page ``S & 1`` of the file ``fd`` still holds exactly this snapshot's bytes.

        Raises:
            OSError: the file cannot be read (a failing disk is not a lost snapshot).
        """
        if self.meta is None:
            return False
        return os.pread(fd, META_BYTES, (self.txnid & 1) * self.meta.psize) == self.meta.raw

    def same_file(self, fd: int) -> bool:
        """Whether the file ``fd`` still holds this snapshot's record fingerprint where it lay (``True`` when it
        is not known).

        Raises:
            OSError: the file cannot be read.
        """
        if self.record is None:
            return True
        off, raw = self.record
        return os.pread(fd, len(raw), off) == raw

    def protected(self, fd: int, txn: Any, env: Any) -> bool:
        """The rule of the module docstring: may the snapshot's pages be trusted now (and are they this file's)?"""
        if self.registered and txn_alive(txn):
            return self.same_file(fd)
        if self.known_layout:
            return self.intact(fd) and self.same_file(fd)
        if not txn_alive(txn):
            return False
        try:
            return int(env.info()["last_txnid"]) <= self.txnid + 1 and self.same_file(fd)
        except lmdb.Error:
            return False


def fingerprint(raw: bytes, offset: int) -> tuple[int, bytes]:
    """The fingerprint of the metadata record ``raw``, which lies at ``offset`` of the file: ``(file offset,
    bytes)`` of its :data:`FINGERPRINT_BYTES` from ``store_id`` on (its last ones for a record without one)."""
    start = raw.find(FINGERPRINT_KEY)
    start = start if start >= 0 else max(0, len(raw) - FINGERPRINT_BYTES)
    return offset + start, raw[start : start + FINGERPRINT_BYTES]


def capture(fd: int, txnid: int, registered: bool, path: str | Path | None = None) -> Snapshot:
    """The snapshot of the transaction ``txnid`` that has just begun, with its meta page read from ``fd``."""
    try:
        size = os.fstat(fd).st_size
        meta = read_meta_page(fd, size, txnid & 1, path)
    except UnsupportedLayout:
        return Snapshot(txnid, registered, None, known_layout=False)
    except Exception:  # a file too short for its meta pages: the open's own checks report it
        return Snapshot(txnid, registered, None)
    return Snapshot(txnid, registered, meta if meta.txnid == txnid else None)
