"""Bounds on what a store may declare, checked before anything is sized by a value read from a file."""

from __future__ import annotations

__all__ = [
    "DEFAULT_LABEL_CHUNK",
    "DEFAULT_MAX_VALUE_BYTES",
    "LMDB_PAGE_SIZE",
    "MAX_CLASSES",
    "MAX_CLASS_NAME_CHARS",
    "MAX_COUNT",
    "MAX_DIM",
    "MAX_NDIM",
    "MAX_SAMPLE_BYTES",
    "MIN_DATA_FILE_BYTES",
]

#: Classes a store may hold (labels are uint8 up to 256 classes, uint16 above).
MAX_CLASSES = 65535
#: Longest class name a file's ``class_names`` member may hold (checked from its header before reading it).
MAX_CLASS_NAME_CHARS = 256
#: Dimensions of one sample, and the largest extent of each.
MAX_NDIM = 4
MAX_DIM = 1 << 16
#: Bytes of one sample.
MAX_SAMPLE_BYTES = 64 * 1024 * 1024
#: Samples in one store.
MAX_COUNT = 1 << 48

#: LMDB's page size when the environment cannot tell: the OS page size, 4 KiB on x86-64 and most arm64.
LMDB_PAGE_SIZE = 4096
#: Every LMDB data file starts with two meta pages (at least one page each).
MIN_DATA_FILE_BYTES = 2 * LMDB_PAGE_SIZE

#: Upper bound on one packed value of a new store; keeps single-sample random reads from touching huge values
#: (re-exported by :mod:`lmdbstore.config`, where the other defaults are named).
DEFAULT_MAX_VALUE_BYTES = 256 * 1024
#: Labels and per-class index lists of a new store are stored in chunks of this many entries.
DEFAULT_LABEL_CHUNK = 1 << 16
