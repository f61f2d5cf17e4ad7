"""Where every packed value of a store lies in ``data.mdb``: the position table of one snapshot.

py-lmdb's value-returning calls touch every page of the value before returning, so out of core one random
2.5 KB sample of a 45 KB value costs 11 page-fault reads, one at a time.  Instead, the reader resolves
each value's file offset once per snapshot (:func:`build_table`, walking the ``samples`` B-tree with
:mod:`lmdbstore.format.btree`), then reads a batch with one ``os.preadv`` per run of consecutive samples
straight into the output array (:class:`~lmdbstore.store.preads.PreadEngine`).  The table costs 8 bytes per
value, plus one bit-sized flag per value saying whether its overflow-page header was checked.

The table is trusted no more than liblmdb trusts the file: the walk checks what a liblmdb lookup relies on
(see :mod:`lmdbstore.format.btree`); the keys must be exactly ``0, k, 2k, ...`` for the metadata's count;
each value's overflow-page header (overflow flag, its own page number, enough pages for the value) is
checked before the value is first read in a process (:func:`check_headers`); and a sample of values is
compared, byte for byte, with what liblmdb returns for the same key.  Any contradiction is a
:class:`~lmdbstore.errors.CorruptStoreError`.  A table is keyed by the store's id, the data file's identity
and the snapshot's meta page (:attr:`PositionTable.key`), and used only while that snapshot is protected
(:mod:`lmdbstore.store.snapshot`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import CorruptStoreError
from lmdbstore.format.btree import samples_positions
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import DAMAGE_HINT, PAGEHDRSZ, LmdbMeta, bad_overflow_headers, overflow_pages
from lmdbstore.store.preads import PreadEngine

__all__ = ["VERIFY_SAMPLE", "PositionTable", "TableKey", "build_table", "check_headers", "check_heads", "table_key"]

#: Values compared with liblmdb's bytes for the same key when a table is built.
VERIFY_SAMPLE = 16
#: What a table is of: (store id, st_dev, st_ino of the data file, txnid, free root, main root, last page).
TableKey = tuple[str, int, int, int, int, int, int]
#: Hint of every contradiction the table finds.
VERIFY_HINT = DAMAGE_HINT


def table_key(store_id: str, st: os.stat_result, snap: LmdbMeta) -> TableKey:
    """The identity of a table: the store, the file and the snapshot (see :attr:`PositionTable.key`)."""
    return (store_id, st.st_dev, st.st_ino, *snap.key)


@dataclass(frozen=True)
class PositionTable:
    """File offsets of every value's payload (value ``v`` holds samples ``v*k .. v*k+k-1``) in one snapshot.

    ``offsets[v]`` is -1 for a value whose length contradicts the metadata (reading it raises).  ``checked``
    (mutable, per process) says which values' overflow headers have been checked (values without overflow
    pages start checked).  ``key`` names the store (its id), the data file (device, inode) and the snapshot
    (its meta page's transaction id, roots and last page): a table is reused only for an equal key.
    """

    key: TableKey
    offsets: np.ndarray  # int64, one per value
    lengths: np.ndarray  # int64: each value's expected length (payload and trailer)
    checked: np.ndarray  # bool, one per value
    file_size: int
    psize: int
    samples_per_value: int

    @property
    def txnid(self) -> int:
        return self.key[3]


def _expected_lengths(meta: StoreMeta) -> np.ndarray:
    n = meta.n_values
    lens = np.full(n, meta.samples_per_value * meta.sample_bytes + meta.trailer_bytes, np.int64)
    if n:
        lens[-1] = meta.expected_value_len((n - 1) * meta.samples_per_value)
    return lens


def _check_keys(keys: np.ndarray, meta: StoreMeta, path: str | Path | None) -> None:
    """The ``samples`` keys must be exactly ``0, k, 2k, ...`` for the metadata's count (see FORMAT.md)."""
    n, spv = meta.n_values, meta.samples_per_value
    common = min(n, len(keys))
    want = np.arange(common, dtype=np.uint64) * np.uint64(spv)
    wrong = np.flatnonzero(keys[:common] != want)
    if wrong.size:
        i = int(wrong[0])
        raise CorruptStoreError(
            f"samples B-tree key {int(keys[i])} where {int(want[i])} belongs",
            path=path,
            key=int(want[i]),
            hint=VERIFY_HINT,
        )
    if len(keys) != n:
        raise CorruptStoreError(
            f"the samples B-tree holds {len(keys)} values; a count of {meta.count} means {n}",
            path=path,
            hint=VERIFY_HINT,
        )


def build_table(
    fd: int,
    meta: StoreMeta,
    snap: LmdbMeta,
    db_name: bytes,
    lookup: Callable[[int], Any],
    engine: PreadEngine,
    *,
    store_id: str = "",
    path: str | Path | None = None,
) -> PositionTable:
    """Build and check the position table of the snapshot ``snap``.

    ``lookup(first)`` returns the value keyed ``first`` through liblmdb (compared with the table's bytes for
    :data:`VERIFY_SAMPLE` values, after their headers are checked).  ``engine`` reads the file (its pool
    reads each tree level's pages in parallel).

    Raises:
        CorruptStoreError: the file contradicts itself, the metadata or liblmdb (pages, keys, lengths,
            overflow headers, sampled values).
    """
    st = os.fstat(fd)
    vals = samples_positions(fd, st.st_size, snap, db_name, path=path, pmap=engine.pmap)
    _check_keys(vals.keys, meta, path)
    lens = _expected_lengths(meta)
    offsets = np.where(vals.sizes == lens, vals.pos, -1).astype(np.int64)
    table = PositionTable(
        table_key(store_id, st, snap), offsets, lens, ~vals.big, st.st_size, snap.psize, meta.samples_per_value
    )
    del vals
    _agrees(table, meta, lookup, engine, path)
    _give_back_free_memory()
    return table


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError):
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return None


def _give_back_free_memory() -> None:
    """Return the parse's freed temporaries to the OS (glibc keeps freed heap memory in the process
    otherwise, and the reader's resident memory would look like it grew with the store)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = _libc()
        if libc is not None:
            libc.malloc_trim(0)


def check_headers(table: PositionTable, values: np.ndarray, engine: PreadEngine, path: str | Path | None) -> None:
    """Check the overflow-page headers of those of ``values`` not checked yet in this process, and mark them.

    Raises:
        CorruptStoreError: a header is not an overflow page, names another page, or has too few pages for the
            value; or a value whose length contradicts the metadata.
    """
    todo = np.unique(values[~table.checked[values]])
    if todo.size == 0:
        return
    offs = table.offsets[todo]
    if (offs < 0).any():
        v = int(todo[offs < 0][0])
        raise CorruptStoreError(
            "value has the wrong length", path=path, key=v * table.samples_per_value, hint=VERIFY_HINT
        )
    heads = engine.gather(offs - PAGEHDRSZ, PAGEHDRSZ)
    check_heads(table, todo, heads, path)


def check_heads(table: PositionTable, values: np.ndarray, heads: np.ndarray, path: str | Path | None) -> None:
    """Check the overflow-page headers ``heads`` (``(n, 16)``, as read) of ``values`` and mark them checked.

    Raises:
        CorruptStoreError: a header is not an overflow page, names another page, or has too few pages.
    """
    page_starts = table.offsets[values] - PAGEHDRSZ
    need = overflow_pages(table.lengths[values], table.psize)
    bad = bad_overflow_headers(heads, page_starts // table.psize, np.asarray(need))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CorruptStoreError(
            f"the overflow page of a value has a wrong header (page {int(page_starts[i] // table.psize)})",
            path=path,
            key=int(values[i]) * table.samples_per_value,
            hint=VERIFY_HINT,
        )
    table.checked[values] = True


def _agrees(
    table: PositionTable, meta: StoreMeta, lookup: Callable[[int], Any], engine: PreadEngine, path: str | Path | None
) -> None:
    """Compare a sample of values (first, last, evenly spread) read by offset with liblmdb's for the same key.

    Raises:
        CorruptStoreError: a sampled value's header is wrong, or its bytes differ from liblmdb's.
    """
    present = np.flatnonzero(table.offsets >= 0)
    if present.size == 0:
        return
    pick = np.unique(present[np.linspace(0, present.size - 1, VERIFY_SAMPLE).astype(int)])
    check_headers(table, pick, engine, path)  # before liblmdb reads them: it trusts their page numbers
    for v in pick.tolist():
        first = v * meta.samples_per_value
        mine = os.pread(engine.fd, int(table.lengths[v]), int(table.offsets[v]))
        theirs = lookup(first)
        if theirs is None or bytes(theirs) != mine:
            raise CorruptStoreError(
                "the value the B-tree walk found differs from liblmdb's for the same key",
                path=path,
                key=first,
                hint=VERIFY_HINT,
            )
