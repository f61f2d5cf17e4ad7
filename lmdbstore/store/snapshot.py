"""When a reader's snapshot is still the file's: the one rule every read of a store follows (docs/design.md,
"Snapshots and the fast path", derives it from LMDB's free-page rule).

A read transaction sees snapshot ``S``.  liblmdb keeps its pages from reuse only while the transaction is registered
(``lock=True``) and alive; otherwise a writer may overwrite them, but not before meta page ``S & 1`` changed:

    the snapshot is protected iff its transaction is registered and alive, or meta page ``S & 1`` still
    holds exactly the bytes it held when the transaction began.

Checked after a read, a protected answer proves the bytes read were ``S``'s (a layout this parser does not know: LMDB's
``env.info()`` with the same bound).  Against another file rewritten in place, every check also compares the
metadata record's bytes from its random ``store_id`` on, where the record lies (:attr:`Snapshot.record`).
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
    """A read transaction's snapshot: its id, whether it is registered, and its meta page as it was (``None``: a layout
    this parser does not know, ``known_layout`` false, or a page overwritten before it was read); ``record``: the
    file offset and bytes of its metadata record's fingerprint (``None``: not known)."""

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
        """Whether meta page ``S & 1`` of the file ``fd`` still holds exactly this snapshot's bytes (``OSError``: the
        file cannot be read; a failing disk is not a lost snapshot)."""
        if self.meta is None:
            return False
        return os.pread(fd, META_BYTES, (self.txnid & 1) * self.meta.psize) == self.meta.raw

    def same_file(self, fd: int) -> bool:
        """Whether the file ``fd`` still holds this snapshot's record fingerprint where it lay (``True`` when it is not
        known; ``OSError``: the file cannot be read)."""
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
