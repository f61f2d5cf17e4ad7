"""Reading ``.npy`` data without loading it (``.npy`` files, ``.npz`` members, a directory's files): header parsing
and checks, and reads into fresh arrays (not ``mmap``: see :mod:`lmdbstore.ingestion.sources`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npformat

from lmdbstore.errors import SourceError, one_line
from lmdbstore.ingestion.sources.checks import READ_ERRORS

__all__ = [
    "NpyHeader",
    "check_sample_dtype",
    "check_size",
    "check_stack",
    "pread_into",
    "read_header",
    "read_into",
    "read_rows",
]

#: Largest single read; bounds the temporary copies a zip stream makes for one ``readinto``.
_READ_CHUNK = 16 << 20
#: Sample dtype kinds a source may hold (bool, ints, unsigned, floats).
_SAMPLE_KINDS = "biuf"


# ---------------------------------------------------------------------------------------------- .npy headers
@dataclass(frozen=True)
class NpyHeader:
    """What an .npy header says: array shape, dtype, memory order, and where the data starts."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran: bool
    offset: int

    @property
    def data_bytes(self) -> int:
        """Bytes of array data the header promises after ``offset``."""
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(fp: Any, path: str | Path, what: str = "the file") -> NpyHeader:
    """Parse the .npy header at the current position of ``fp`` (a file or a zip member stream).

    Raises:
        SourceError: not an .npy header, or a format version other than 1.0 and 2.0 (``what`` names the array).
    """
    try:
        version = npformat.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = npformat.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = npformat.read_array_header_2_0(fp)
        else:
            raise SourceError(f"{what} has unsupported .npy format version {version[0]}.{version[1]}", path=path)
        offset = fp.tell()
    except READ_ERRORS as exc:
        raise SourceError(f"{what} is not a valid .npy array ({one_line(exc)})", path=path) from exc
    return NpyHeader(tuple(int(s) for s in shape), np.dtype(dtype), bool(fortran), int(offset))


def check_sample_dtype(dtype: np.dtype[Any], path: str | Path, what: str) -> None:
    """Samples must be plain numbers (``SourceError`` for objects, fields, or a kind other than bool, int, unsigned
    or float)."""
    if dtype.hasobject:
        raise SourceError(
            f"{what} holds Python objects (dtype {dtype}); samples must be numeric",
            path=path,
            hint="save a numeric array",
        )
    if dtype.fields is not None or dtype.kind not in _SAMPLE_KINDS:
        raise SourceError(f"{what} has dtype {dtype}; samples must be numeric (bool, int or float)", path=path)


def check_stack(h: NpyHeader, path: str | Path, what: str) -> None:
    """An array of samples: numeric, (N, *shape) with ndim >= 2, N >= 1, samples not empty (else ``SourceError``)."""
    check_sample_dtype(h.dtype, path, what)
    if len(h.shape) < 2:
        raise SourceError(
            f"{what} has shape {h.shape}; expected a stack of samples (N, *sample_shape) with ndim >= 2", path=path
        )
    if h.shape[0] == 0:
        raise SourceError(f"{what} holds no samples (shape {h.shape})", path=path)
    if math.prod(h.shape[1:]) == 0:
        raise SourceError(f"{what} has empty samples (shape {h.shape})", path=path)


def check_size(h: NpyHeader, have: int, path: str | Path, what: str) -> None:
    """The bytes present (``have``) must be exactly header + data (else ``SourceError``: truncated, malformed)."""
    want = h.offset + h.data_bytes
    if have < want:
        raise SourceError(
            f"{what} is truncated: its header promises shape {h.shape} ({want} bytes) but only {have} bytes exist",
            path=path,
        )
    if have > want:
        raise SourceError(
            f"{what} is malformed: {have - want} unexpected bytes after the shape {h.shape} array", path=path
        )


# ---------------------------------------------------------------------------------------------- reading helpers
def read_into(fp: Any, out: np.ndarray, path: str | Path, first: int) -> None:
    """Fill ``out`` (C-contiguous) from ``fp``, in reads of at most 16 MiB.

    Raises:
        SourceError: the read failed, or ``fp`` ended early (``key``: the first row not read in full).
    """
    mv = out.reshape(-1).view(np.uint8).data
    total, got = len(mv), 0
    try:
        while got < total:
            n = fp.readinto(mv[got : min(total, got + _READ_CHUNK)])
            if not n:
                break
            got += n
    except READ_ERRORS as exc:
        raise SourceError(f"read failed ({one_line(exc)})", path=path, key=first) from exc
    if got < total:
        row = out.nbytes // max(len(out), 1)
        raise SourceError("file ended early (truncated while reading)", path=path, key=first + got // max(row, 1))


def read_rows(fp: Any, h: NpyHeader, path: str | Path, what: str, batch: int, start: int) -> Iterator[np.ndarray]:
    """Rows ``start..`` of the array of header ``h`` in ``fp`` (a file or a zip member stream), in arrays of
    ``batch`` rows.  Rows strided on disk (Fortran order) are read one run of values per column, forward seeks only
    (memory stays one batch; the price is one pass over the array per batch, a rare layout).

    Raises:
        SourceError: a read failed, or the data ended early (``what`` names the array).
    """
    n, size = h.shape[0], h.dtype.itemsize
    columns = math.prod(h.shape[1:])
    strided, a = h.fortran and len(h.shape) > 1 and columns > 1, start
    try:
        fp.seek(h.offset + (0 if strided else start * columns * size))
        for a in range(start, n, batch):
            k = min(batch, n - a)
            if not strided:
                out = np.empty((k, *h.shape[1:]), h.dtype)
                read_into(fp, out, path, a)
                yield out
                continue
            buf = np.empty((columns, k), h.dtype)
            for c in range(columns):
                fp.seek(h.offset + (c * n + a) * size)
                read_into(fp, buf[c], path, a)
            # buf holds the C-order array of shape (*reversed(shape[1:]), k); transposing gives (k, *shape[1:])
            yield np.ascontiguousarray(buf.reshape(*h.shape[:0:-1], k).transpose())
    except READ_ERRORS as exc:
        raise SourceError(f"read failed in {what} ({one_line(exc)})", path=path, key=a) from exc


def pread_into(path: str, offset: int, mv: memoryview, first: int) -> None:
    """Read ``len(mv)`` bytes of file ``path`` at ``offset`` into ``mv`` (cheap for many tiny files).

    Raises:
        SourceError: the file cannot be read, or ended early (``key`` is ``first``).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            got = 0
            while got < len(mv):
                n = os.preadv(fd, [mv[got:]], offset + got)  # as the store's own reads (format.pages)
                if not n:
                    break
                got += n
        finally:
            os.close(fd)
    except OSError as exc:
        raise SourceError(f"read failed ({one_line(exc)})", path=path, key=first) from exc
    if got < len(mv):
        raise SourceError("file ended early (truncated since it was opened)", path=path, key=first)
