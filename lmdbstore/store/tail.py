"""The writer's tail: the partly filled last value, label chunk and class-index chunks of a store, which the next
commit rewrites; kept in memory (:class:`Tail`), read when the writer opens (:func:`load_tail`), rebuilt by every
commit, so appending never re-reads the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from lmdbstore.errors import CorruptStoreError
from lmdbstore.format.layout import DB_CLASSIDX, DB_LABELS, DB_SAMPLES, INDEX_DTYPE, classidx_key, encode_key
from lmdbstore.format.meta import StoreMeta

__all__ = ["Tail", "load_tail"]


@dataclass
class Tail:
    """In-memory copy of what the next commit must rewrite: the last, partly filled chunks."""

    samples: bytes = b""  # payload of the last value if it holds fewer than samples_per_value
    labels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    class_tails: dict[int, np.ndarray] = field(default_factory=dict)


def load_tail(env: lmdb.Environment, dbs: dict[bytes, Any], meta: StoreMeta, path: Path) -> Tail:
    """Read the partly filled last value, label chunk and class-index chunks of the store as of ``meta`` (its count
    and class counts say which are partial), through the writer's environment ``env`` and sub-databases ``dbs``
    (``CorruptStoreError``: a partial piece the metadata implies is missing or has the wrong length)."""
    m = meta
    tail = Tail(labels=np.zeros(0, m.label_dtype))
    with env.begin(buffers=False) as txn:

        def piece(db: bytes, key: bytes, size: int, what: str, first: int | None = None) -> bytes:
            raw = txn.get(key, db=dbs[db])
            if raw is None or len(raw) != size:
                raise CorruptStoreError(f"{what} is missing or has the wrong length", path=path, key=first)
            return raw  # type: ignore[no-any-return]

        n_tail, n_lab = m.count % m.samples_per_value, m.count % m.label_chunk
        if n_tail:
            first = m.count - n_tail
            raw = piece(DB_SAMPLES, encode_key(first), m.expected_value_len(first), "last value", first)
            tail.samples = raw[: n_tail * m.sample_bytes]
        if n_lab:
            first = m.count - n_lab
            raw = piece(DB_LABELS, encode_key(first), n_lab * m.label_dtype.itemsize, "last label chunk", first)
            tail.labels = np.frombuffer(raw, m.label_dtype).copy()
        for c, n_c in enumerate(m.class_counts):
            if n_c % m.label_chunk:
                n, what = n_c % m.label_chunk, f"last index chunk of class {m.classes[c]!r}"
                raw = piece(DB_CLASSIDX, classidx_key(c, n_c - n), n * INDEX_DTYPE.itemsize, what)
                tail.class_tails[c] = np.frombuffer(raw, INDEX_DTYPE).copy()
    return tail
