"""The per-value checksums, in one table: each kind's name, trailer size and function.

Every value of ``samples`` ends with a trailer of the store's checksum kind over the value's payload
(little-endian, like crc32's natural byte order).  ``xxh64`` needs the optional ``xxhash`` package.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Literal

from lmdbstore.errors import LmdbStoreError

__all__ = ["CHECKSUM_KINDS", "ChecksumKind", "checksum_size", "compute_checksum"]

ChecksumKind = Literal["none", "crc32", "xxh64"]


def _xxh64(data: bytes | memoryview) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise LmdbStoreError(
            "this store uses xxh64 checksums but the xxhash package is not installed",
            hint="pip install 'lmdbstore[xxhash]'",
        ) from exc
    return bytes(xxhash.xxh64_digest(data)[::-1])  # little-endian like crc32


def _crc32(data: bytes | memoryview) -> bytes:
    return struct.pack("<I", zlib.crc32(data))


#: kind -> (trailer bytes, function of the payload returning the trailer; ``None`` for no checksum)
_TABLE: dict[str, tuple[int, Callable[[bytes | memoryview], bytes] | None]] = {
    "none": (0, None),
    "crc32": (4, _crc32),
    "xxh64": (8, _xxh64),
}
#: The checksum kinds a store may use.
CHECKSUM_KINDS: tuple[ChecksumKind, ...] = ("none", "crc32", "xxh64")
assert set(CHECKSUM_KINDS) == set(_TABLE)


def checksum_size(kind: str) -> int:
    """Bytes of the checksum trailer appended to every value for checksum ``kind``."""
    return _TABLE[kind][0]


def compute_checksum(kind: str) -> Callable[[bytes | memoryview], bytes] | None:
    """The function that computes the trailer for checksum ``kind``, or ``None`` for ``"none"``.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in _TABLE:
        raise ValueError(f"unknown checksum kind {kind!r}")
    return _TABLE[kind][1]
