"""Reading a store's label table and per-class index lists (behind :class:`~lmdbstore.store.reader.StoreReader`).

Labels are stored ``label_chunk`` to a chunk (one class id per sample, the label dtype); each class's sample
indices are stored as ascending little-endian uint64 lists, chunked the same way (``docs/FORMAT.md``).  Both
are read whole, in the handle's snapshot, and checked against the metadata as they are read.
"""

from __future__ import annotations

import numpy as np

from lmdbstore.errors import CorruptStoreError, translate_read_errors
from lmdbstore.format.layout import DB_CLASSIDX, DB_LABELS, INDEX_DTYPE, classidx_key, encode_key
from lmdbstore.store.handle import Handle

__all__ = ["read_class_indices", "read_labels"]


def read_labels(h: Handle) -> np.ndarray:
    """Every sample's class id, in sample order (the label dtype: uint8 up to 256 classes).

    Raises:
        CorruptStoreError: a label chunk is missing or of the wrong length, or a label is not a class id.
    """
    m = h.meta
    out = np.empty(m.count, m.label_dtype)
    pos = 0
    with translate_read_errors(h.path, "read labels"), h.lmdb():
        for first in range(0, m.count, m.label_chunk):
            raw = h.txn.get(encode_key(first), db=h.dbs[DB_LABELS])
            n = min(m.label_chunk, m.count - first)
            if raw is None or len(raw) != n * m.label_dtype.itemsize:
                raise CorruptStoreError("label chunk missing or of the wrong length", path=h.path, key=first)
            out[pos : pos + n] = np.frombuffer(raw, m.label_dtype)
            pos += n
    if m.count and int(out.max()) >= len(m.classes):
        raise CorruptStoreError("a label is outside the class list", path=h.path)
    return out


def read_class_indices(h: Handle, class_id: int) -> np.ndarray:
    """The sample indices of class ``class_id`` in ascending order (int64), from the class-index table.

    Raises:
        CorruptStoreError: a chunk of the class's list is missing or of the wrong length, or the list is not
            ascending sample indices of the store.
    """
    m = h.meta
    n_c = m.class_counts[class_id]
    out = np.empty(n_c, np.int64)
    with translate_read_errors(h.path, "read class index"), h.lmdb():
        for pos in range(0, n_c, m.label_chunk):
            raw = h.txn.get(classidx_key(class_id, pos), db=h.dbs[DB_CLASSIDX])
            n = min(m.label_chunk, n_c - pos)
            if raw is None or len(raw) != n * INDEX_DTYPE.itemsize:
                raise CorruptStoreError(
                    f"class-index chunk of class {m.classes[class_id]!r} missing or of the wrong length",
                    path=h.path,
                    key=pos,
                )
            out[pos : pos + n] = np.frombuffer(raw, INDEX_DTYPE)
    if n_c and (int(out[0]) < 0 or int(out[-1]) >= m.count or (n_c > 1 and not (out[1:] > out[:-1]).all())):
        raise CorruptStoreError(  # one pass: the list is ascending sample indices of the store
            f"the class index of class {m.classes[class_id]!r} is not ascending sample indices below {m.count}",
            path=h.path,
            hint="run `lmdbstore verify` on the store",
        )
    return out
