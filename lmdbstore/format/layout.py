"""Where every byte of a store lives (docs/FORMAT.md): the format's name and version, the sub-databases of its one
LMDB environment, and their key encodings.
"""

from __future__ import annotations

import struct

import numpy as np

from lmdbstore.errors import CorruptStoreError

__all__ = [
    "ALL_DBS",
    "DATA_DBS",
    "DB_CLASSIDX",
    "DB_LABELS",
    "DB_META",
    "DB_PROGRESS",
    "CLASSIDX_KEY_BYTES",
    "DB_SAMPLES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_DTYPE",
    "KEY_BYTES",
    "MAX_DBS",
    "META_KEY",
    "classidx_key",
    "decode_classidx_key",
    "decode_key",
    "encode_key",
]

FORMAT_NAME = "lmdbstore"
FORMAT_VERSION = 1

DB_SAMPLES = b"samples"
DB_LABELS = b"labels"
DB_CLASSIDX = b"classidx"
DB_META = b"meta"
DB_PROGRESS = b"progress"
#: Every sub-database of a store, in the order the writer creates them.
ALL_DBS = (DB_SAMPLES, DB_LABELS, DB_CLASSIDX, DB_META, DB_PROGRESS)
#: The sub-databases a reader keeps open (the metadata is read once, on open).
DATA_DBS = tuple(db for db in ALL_DBS if db != DB_META)
#: Key of the one record of ``meta``.
META_KEY = b"meta"
#: ``max_dbs`` every environment of a store is opened with (room beyond :data:`ALL_DBS`).
MAX_DBS = 8

_KEY = struct.Struct(">Q")
_CLASSIDX_KEY = struct.Struct(">HQ")
#: Width of a ``samples`` or ``labels`` key (a big-endian uint64 sample index).
KEY_BYTES = _KEY.size
#: Width of a ``classidx`` key (a big-endian uint16 class id, then a big-endian uint64 list position).
CLASSIDX_KEY_BYTES = _CLASSIDX_KEY.size
#: Per-class index lists are stored as little-endian uint64.
INDEX_DTYPE = np.dtype("<u8")


def encode_key(index: int) -> bytes:
    """Fixed-width big-endian key, so LMDB's byte order is index order (and ``append=True`` works)."""
    return _KEY.pack(index)


def decode_key(key: bytes) -> int:
    """Inverse of :func:`encode_key`; raises ``CorruptStoreError`` for a key of the wrong width."""
    if len(key) != _KEY.size:
        raise CorruptStoreError(f"key of {len(key)} bytes, expected {_KEY.size}", key=key.hex())
    return int(_KEY.unpack(key)[0])


def classidx_key(class_id: int, position: int) -> bytes:
    """Key of the chunk of class ``class_id``'s index list that starts at ``position`` in that list."""
    return _CLASSIDX_KEY.pack(class_id, position)


def decode_classidx_key(key: bytes) -> tuple[int, int]:
    """Inverse of :func:`classidx_key`: ``(class_id, position)``; raises ``CorruptStoreError`` for a key of the
    wrong width."""
    if len(key) != _CLASSIDX_KEY.size:
        raise CorruptStoreError(f"key of {len(key)} bytes, expected {_CLASSIDX_KEY.size}", key=key.hex())
    class_id, position = _CLASSIDX_KEY.unpack(key)
    return int(class_id), int(position)
