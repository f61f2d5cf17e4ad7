"""One store or a set of them, as the loader and the tools take them: :func:`open_reader` (public), :func:`as_reader`
(unopened, readers passed through) and :func:`data_file_bytes`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from lmdbstore.store.env import DATA_FILE
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader

__all__ = ["Reader", "as_reader", "data_file_bytes", "open_reader"]

StorePath = str | os.PathLike[str]

#: What the loader and the tools read: one store or a set of them.
Reader = StoreReader | StoreSet


def as_reader(store: StorePath | Sequence[StorePath] | Reader) -> Reader:
    """A reader for ``store``: a path gives a :class:`StoreReader`, a list or tuple of paths a :class:`StoreSet`,
    a reader or set is used as it is (not opened)."""
    if isinstance(store, (StoreReader, StoreSet)):
        return store
    if isinstance(store, (list, tuple)):
        return StoreSet(store)
    return StoreReader(store)  # type: ignore[arg-type]


def open_reader(
    store: StorePath | Sequence[StorePath],
    *,
    lock: bool | None = None,
    verify_checksums: bool = False,
    classes: Sequence[str] | None = None,
) -> Reader:
    """Open a store -- or, given a list of stores, a :class:`StoreSet` reading them as one -- and validate it now;
    ``classes`` fixes a set's class order (refused for a single store).

    Raises:
        ValueError: ``classes`` for a single store; an empty list or a store given twice.
        ValidationError: stores of a set that do not make one set.
        StoreNotFoundError, NotAStoreError, CorruptStoreError, FormatVersionError: a store.
    """
    if isinstance(store, (list, tuple)):
        return StoreSet(store, classes=classes, lock=lock, verify_checksums=verify_checksums).open()
    if classes is not None:
        raise ValueError("classes: only a set of stores (a list) takes a class order")
    return StoreReader(cast(StorePath, store), lock=lock, verify_checksums=verify_checksums).open()


def data_file_bytes(reader: Reader) -> int:
    """Bytes of the data file(s) behind ``reader`` (what must fit the page cache for random reads)."""
    paths = reader.paths if isinstance(reader, StoreSet) else [reader.path]
    return sum(os.path.getsize(Path(p) / DATA_FILE) for p in paths)
