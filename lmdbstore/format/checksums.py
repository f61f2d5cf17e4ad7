"""The per-value checksums, in one table: each kind's trailer size and function.  Every value of ``samples`` ends with
a little-endian trailer of the store's kind over its payload.  ``crc32`` is computed by ISA-L where the optional
``isal`` package is installed (``lmdbstore[fast]``: 12-15 GB/s a core against zlib's ~2.2, the same numbers), else by
``zlib``; ``xxh64`` needs ``xxhash``.  :func:`checksum_int` equals the trailer read as :func:`trailer_dtype`, so a
verifier compares a whole batch of trailers at once.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Literal

import numpy as np

from lmdbstore.errors import LmdbStoreError

__all__ = ["CHECKSUM_KINDS", "ChecksumKind", "checksum_int", "checksum_size", "compute_checksum", "trailer_dtype"]

ChecksumKind = Literal["none", "crc32", "xxh64"]
#: A checksum as an integer: ``fn(payload) -> int`` (the trailer read as a little-endian integer).
IntChecksum = Callable[[bytes | memoryview], int]
#: The checksum kinds a store may use.
CHECKSUM_KINDS: tuple[ChecksumKind, ...] = ("none", "crc32", "xxh64")
#: Each kind's trailer bytes.
_SIZES = dict(zip(CHECKSUM_KINDS, (0, 4, 8), strict=True))


@functools.cache
def _crc32() -> IntChecksum:
    """The fastest CRC-32 at hand: ISA-L's where ``isal`` is installed, else zlib's."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return zlib.crc32
    return crc32  # type: ignore[no-any-return]


def _xxh64(data: bytes | memoryview) -> int:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise LmdbStoreError(
            "this store uses xxh64 checksums but the xxhash package is not installed",
            hint="pip install 'lmdbstore[xxhash]'",
        ) from exc
    return int(xxhash.xxh64_intdigest(data))


def checksum_size(kind: str) -> int:
    """Bytes of the checksum trailer appended to every value for checksum ``kind`` (``ValueError``: an unknown kind)."""
    if kind not in _SIZES:
        raise ValueError(f"unknown checksum kind {kind!r}")
    return _SIZES[kind]


def checksum_int(kind: str) -> IntChecksum | None:
    """The checksum of kind ``kind`` as an integer, equal to its trailer read as :func:`trailer_dtype` (``None`` for
    ``"none"``). For ``crc32`` it is the library's own function (no wrapper per call).  Raises ``ValueError``: an
    unknown kind."""
    checksum_size(kind)
    return {"crc32": _crc32(), "xxh64": _xxh64}.get(kind)


def compute_checksum(kind: str) -> Callable[[bytes | memoryview], bytes] | None:
    """The function that computes the trailer for checksum ``kind``, or ``None`` for ``"none"`` (``ValueError``: an
    unknown kind)."""
    fn, size = checksum_int(kind), checksum_size(kind)
    return None if fn is None else lambda data: fn(data).to_bytes(size, "little")


def trailer_dtype(kind: str) -> np.dtype:
    """The trailer of kind ``kind`` as one little-endian unsigned integer (``<u4``, ``<u8``; ``kind`` "none": a
    zero-width ``V0``).  Raises ``ValueError``: an unknown kind."""
    size = checksum_size(kind)
    return np.dtype(f"<u{size}") if size else np.dtype("V0")
