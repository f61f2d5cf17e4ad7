"""TFRecord framing and ``tf.train.Example`` messages, read and written without TensorFlow.

A TFRecord file is a sequence of records, each framed as::

    uint64 length            little-endian
    uint32 masked crc32c     of the 8 length bytes
    byte   data[length]      here a serialized tf.train.Example
    uint32 masked crc32c     of the data

where ``masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2**32)``.  The crc32c (Castagnoli) comes from
``google-crc32c`` (the optional ``tfrecord`` extra: Google's C implementation, hardware-accelerated, 40 KB, no
dependencies; docs/design.md says why it and not ``protobuf``/TensorFlow).

``tf.train.Example`` is the protobuf message ``Example{Features features = 1}``, ``Features{map<string, Feature>
feature = 1}``, ``Feature{oneof {BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3}}``,
each list ``repeated <type> value = 1`` (floats and ints packed, as TensorFlow writes them; unpacked ones are
read too).  :func:`parse_example` decodes the wire format of just these messages (unknown fields skipped), every
length checked against the bytes it lies in, so a damaged or hostile record is a :class:`ValueError` and never
an allocation beyond its own size.  :func:`encode_example` and :func:`write_records` write the same format (what
the tests and the benchmark make their shards with; TensorFlow reads them).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lmdbstore.errors import SourceError

__all__ = [
    "HEADER_BYTES",
    "Feature",
    "crc32c_module",
    "encode_example",
    "masked_crc",
    "parse_example",
    "write_records",
]

#: Bytes before a record's data: its length and that length's masked crc32c.
HEADER_BYTES = 12
#: Bytes after a record's data: its masked crc32c.
FOOTER_BYTES = 4
_MASK_DELTA = 0xA282EAD8
_BYTES, _FLOATS, _INTS = 1, 2, 3
#: The kinds of a feature, by field number of ``Feature``.
KINDS = {_BYTES: "bytes", _FLOATS: "float", _INTS: "int64"}

#: A decoded feature: its kind (``"bytes"``, ``"float"``, ``"int64"``) and value (a list of ``bytes``, a float32
#: array, an int64 array).
Feature = tuple[str, Any]


def crc32c_module(path: Path | None = None) -> Any:
    """The ``google_crc32c`` module, or a one-line SourceError naming the extra that installs it."""
    try:
        import google_crc32c
    except ImportError as exc:
        raise SourceError(
            "reading TFRecord files needs the google-crc32c package (their records are crc32c-checked)",
            path=path,
            hint="pip install 'lmdbstore[tfrecord]'",
        ) from exc
    return google_crc32c


def masked_crc(crc: int) -> int:
    """TFRecord's masking of a crc32c value."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# --------------------------------------------------------------------------------------------------- reading
def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (at most 10 bytes, before ``end``) and the position after it."""
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(field, wire type, start, stop)`` of each field of the message in ``buf[pos:end]``; for a varint
    field ``start`` is its value and ``stop`` the position after it."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value, pos
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            if n > end - pos:
                raise ValueError(f"field {field} claims {n} bytes, {end - pos} are left")
            yield field, wire, pos, pos + n
            pos += n
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if size > end - pos:
                raise ValueError(f"field {field} is cut short")
            yield field, wire, pos, pos + size
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _decode_list(buf: bytes, kind: int, pos: int, end: int) -> Any:
    """The values of a BytesList, FloatList or Int64List message in ``buf[pos:end]``."""
    if kind == _BYTES:
        return [buf[a:b] for f, w, a, b in _fields(buf, pos, end) if f == 1 and w == 2]
    floats: list[np.ndarray] = []
    ints: list[int] = []
    for f, w, a, b in _fields(buf, pos, end):
        if f != 1:
            continue
        if kind == _FLOATS and w == 2:  # packed
            if (b - a) % 4:
                raise ValueError("a packed float list's length is not a multiple of 4")
            floats.append(np.frombuffer(buf, "<f4", (b - a) // 4, a))
        elif kind == _FLOATS and w == 5:
            floats.append(np.frombuffer(buf, "<f4", 1, a))
        elif kind == _INTS and w == 2:  # packed
            p = a
            while p < b:
                v, p = _varint(buf, p, b)
                ints.append(_signed(v))
        elif kind == _INTS and w == 0:
            ints.append(_signed(a))
        else:
            raise ValueError(f"a {KINDS[kind]} list holds a field of wire type {w}")
    if kind == _FLOATS:
        return np.concatenate(floats) if len(floats) != 1 else floats[0]
    return np.asarray(ints, np.int64)


def parse_example(buf: bytes, wanted: Iterable[str] | None = None) -> dict[str, Feature]:
    """The features of a serialized ``tf.train.Example`` (only those named in ``wanted``, when given).

    Raises:
        ValueError: the bytes are no well-formed Example.
    """
    keep = set(wanted) if wanted is not None else None
    out: dict[str, Feature] = {}
    end = len(buf)
    vals: Any
    for f, w, a, b in _fields(buf, 0, end):
        if f != 1 or w != 2:
            continue  # Example.features is field 1
        for f2, w2, a2, b2 in _fields(buf, a, b):
            if f2 != 1 or w2 != 2:
                continue  # Features.feature (map entries) is field 1
            name: str | None = None
            value: tuple[int, int] | None = None
            for f3, w3, a3, b3 in _fields(buf, a2, b2):
                if f3 == 1 and w3 == 2:
                    name = buf[a3:b3].decode("utf-8", "replace")
                elif f3 == 2 and w3 == 2:
                    value = (a3, b3)
            if name is None or (keep is not None and name not in keep):
                continue
            kind, vals = "bytes", []  # an empty Feature is an empty list
            if value is not None:  # Feature: a oneof of the three lists
                for f4, w4, a4, b4 in _fields(buf, *value):
                    if f4 in KINDS and w4 == 2:
                        kind, vals = KINDS[f4], _decode_list(buf, f4, a4, b4)
            out[name] = (kind, vals)
    return out


def read_header(f: BinaryIO, crc: Any, at: int, index: int, path: Path) -> int | None:
    """The data length of the record starting at ``at`` (``f`` positioned there), its length's crc checked;
    ``None`` at the end of the file.

    Raises:
        SourceError: a cut header or a length crc that does not match (naming the record).
    """
    head = f.read(HEADER_BYTES)
    if not head:
        return None
    if len(head) < HEADER_BYTES:
        raise SourceError(f"record {index} is cut short: {len(head)} of its {HEADER_BYTES} header bytes", path=path)
    length, want = struct.unpack("<QI", head)
    if masked_crc(crc.value(head[:8])) != want:
        raise SourceError(f"record {index} is damaged: the crc32c of its length does not match", path=path)
    return int(length)


# --------------------------------------------------------------------------------------------------- writing
def _key(field: int, wire: int) -> bytes:
    return _put_varint((field << 3) | wire)


def _put_varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _put_varint(len(payload)) + payload


def _feature(value: Any) -> bytes:
    """A serialized ``Feature``: ``bytes`` (or a list of them) as a BytesList, float arrays as a FloatList,
    integer arrays and ints as an Int64List."""
    if isinstance(value, (bytes, bytearray)):
        value = [bytes(value)]
    if isinstance(value, str):
        value = [value.encode()]
    if isinstance(value, list) and value and isinstance(value[0], (bytes, bytearray)):
        return _len_field(_BYTES, b"".join(_len_field(1, bytes(v)) for v in value))
    arr = np.atleast_1d(np.asarray(value))
    if arr.dtype.kind == "f":
        packed = arr.astype("<f4").tobytes()
        return _len_field(_FLOATS, _len_field(1, packed))
    if arr.dtype.kind in "iub":
        packed = b"".join(_put_varint(int(v)) for v in arr.reshape(-1))
        return _len_field(_INTS, _len_field(1, packed))
    raise TypeError(f"cannot encode a feature of dtype {arr.dtype}")


def encode_example(features: Mapping[str, Any]) -> bytes:
    """A serialized ``tf.train.Example`` of ``features`` (name -> bytes, float array or int array)."""
    entries = b"".join(
        _len_field(1, _len_field(1, name.encode()) + _len_field(2, _feature(value))) for name, value in features.items()
    )
    return _len_field(1, entries)


def write_records(path: str | os.PathLike[str], records: Iterable[bytes]) -> int:
    """Write ``records`` to a TFRecord file at ``path`` (framed and crc32c-checked); return how many."""
    crc = crc32c_module()
    n = 0
    with open(path, "wb") as f:
        for data in records:
            head = struct.pack("<Q", len(data))
            f.write(head + struct.pack("<I", masked_crc(crc.value(head))))
            f.write(data + struct.pack("<I", masked_crc(crc.value(data))))
            n += 1
    return n
