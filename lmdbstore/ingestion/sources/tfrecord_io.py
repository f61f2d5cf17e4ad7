"""TFRecord files and ``tf.train.Example`` messages, read without TensorFlow (tests/tfrecord_writer.py writes them).

A TFRecord file is a sequence of records, each framed as::

    uint64 length            little-endian
    uint32 masked crc32c     of the 8 length bytes
    byte   data[length]      here a serialized tf.train.Example
    uint32 masked crc32c     of the data

where ``masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2**32)``; the whole file may be one GZIP or ZLIB
stream (TensorFlow's ``compression_type``), inflated as read (:class:`RecordFile`).  The crc32c comes from
``google-crc32c`` (the ``tfrecord`` extra; docs/design.md says why it and not ``protobuf``/TensorFlow).

``tf.train.Example`` is ``Example{Features features = 1}``, ``Features{map<string, Feature> feature = 1}``,
``Feature{oneof {BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3}}``, each list
``repeated <type> value = 1``.  :func:`parse_example` decodes them through one walker of every wire type
(:func:`_fields`), every length checked and a list's values counted before they are allocated, so a damaged or
hostile record is a :class:`ValueError`, never an allocation beyond a few times its own size.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import SourceError, one_line

__all__ = [
    "COMPRESSIONS",
    "KINDS",
    "Feature",
    "RecordFile",
    "crc32c_module",
    "feature_names",
    "masked_crc",
    "parse_example",
]

#: Bytes before a record's data: its length and that length's masked crc32c.
HEADER_BYTES = 12
#: Bytes after a record's data: its masked crc32c.
FOOTER_BYTES = 4
_MASK_DELTA = 0xA282EAD8
_BYTES, _FLOATS, _INTS = 1, 2, 3
#: The kinds of a feature, by field number of ``Feature`` (an empty ``Feature`` is ``"empty"``).
KINDS = {_BYTES: "bytes", _FLOATS: "float", _INTS: "int64"}
#: Compressions of a TFRecord file (TensorFlow's ``compression_type``), as :mod:`zlib` ``wbits``; 0: none.
COMPRESSIONS = {"none": 0, "zlib": 15, "gzip": 31}
#: Most bytes read (or inflated) at once: what reading adds to memory besides the record being read.
_CHUNK = 1 << 20

#: A decoded feature: its kind and values: float32 or int64 values, or for bytes each value's (start, stop)
#: in the record, an ``(n, 2)`` int64 array.
Feature = tuple[str, np.ndarray]


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


# --------------------------------------------------------------------------------------------------- records
class RecordFile:
    """The records of a TFRecord file, in order: plain, or one GZIP or ZLIB stream inflated as read
    (``compression``, a key of :data:`COMPRESSIONS`; ``None``: told by the first bytes, a plain file by its first
    length's crc32c), in pieces of at most 1 MiB, so a record's claimed length allocates nothing by itself.
    :meth:`next` reads a record (or passes over it); every fault is a one-line SourceError naming the record."""

    def __init__(self, path: Path, compression: str | None, crc: Any) -> None:
        self.path, self.index, self._crc = path, 0, crc
        try:
            self._f = io.BufferedReader(io.FileIO(path), _CHUNK)  # closed by __exit__
            head = self._f.peek(HEADER_BYTES)[:HEADER_BYTES]
        except OSError as exc:
            raise SourceError(f"cannot open ({one_line(exc)})", path=path) from exc
        if compression is None:
            plain = len(head) == HEADER_BYTES and masked_crc(crc.value(head[:8])) == struct.unpack("<I", head[8:])[0]
            zlib_head = len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
            compression = "none" if plain else "gzip" if head[:2] == b"\x1f\x8b" else "zlib" if zlib_head else "none"
        self.compression, self._wbits = compression, COMPRESSIONS[compression]
        self._inflate = zlib.decompressobj(self._wbits) if self._wbits else None
        self._size = os.fstat(self._f.fileno()).st_size

    def __enter__(self) -> RecordFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def _some(self, n: int) -> bytes:
        """Up to ``n`` (>= 1) more bytes of the records, ``b""`` at their end."""
        d = self._inflate
        if d is None:
            return self._f.read(n)
        while True:
            if d.eof:  # another stream may follow (gzip members are concatenated)
                data = d.unused_data or self._f.read(_CHUNK)
                if not data:
                    return b""
                d = self._inflate = zlib.decompressobj(self._wbits)
            elif d.unconsumed_tail:
                data = d.unconsumed_tail
            elif not (data := self._f.read(_CHUNK)):
                raise EOFError("the compressed stream is cut short")
            if out := d.decompress(data, n):
                return out

    def _take(self, n: int, keep: bool = True) -> tuple[bytes, int]:
        """The next ``n`` bytes (fewer at the end) when ``keep`` (else passed over: a seek when plain), and how
        many there were."""
        if not keep and self._inflate is None:
            at = self._f.tell()
            return b"", self._f.seek(min(at + n, self._size)) - at
        parts, got = [], 0
        while got < n and (piece := self._some(min(n - got, _CHUNK))):
            parts.append(piece if keep else b"")
            got += len(piece)
        return b"".join(parts), got

    def next(self, keep: bool = True) -> bytes | None:
        """The next record's data, its crc32c checked (``b""`` when not ``keep``: passed over, its length
        checked); ``None`` after the last record."""
        i, where = self.index, self.path
        try:
            head, _ = self._take(HEADER_BYTES)
            if not head:
                return None
            if len(head) < HEADER_BYTES:
                raise SourceError(
                    f"record {i} is cut short: {len(head)} of its {HEADER_BYTES} header bytes", path=where
                )
            length, want = struct.unpack("<QI", head)
            if masked_crc(self._crc.value(head[:8])) != want:
                raise SourceError(
                    f"record {i} is damaged: the crc32c of its length does not match",
                    path=where,
                    hint="is it compressed some other way? (compression=)" if i == 0 else None,
                )
            data, got = self._take(length, keep)
            foot, _ = self._take(FOOTER_BYTES)
        except (OSError, EOFError, zlib.error) as exc:
            raise SourceError(f"read failed at record {i} ({one_line(exc)})", path=where) from exc
        if got < length or len(foot) < FOOTER_BYTES:
            raise SourceError(
                f"record {i} is cut short: it claims {length} bytes of data, the file ends first", path=where
            )
        if keep and masked_crc(self._crc.value(data)) != struct.unpack("<I", foot)[0]:
            raise SourceError(f"record {i} is damaged: the crc32c of its data does not match", path=where)
        self.index += 1
        return data


# --------------------------------------------------------------------------------------------------- messages
def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (at most 10 bytes, before ``end``, below 2**64) and the position after it."""
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("a varint is cut short or longer than 10 bytes")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            if result >> 64:
                raise ValueError("a varint is above 2**64")
            return result, pos
        shift += 7


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(field, wire type, start, stop)`` of each field of the message in ``buf[pos:end]``, every wire type
    (varint, fixed64, length-delimited, fixed32); for a varint field ``start`` is its value."""
    while pos < end:
        key = buf[pos]  # one-byte keys and lengths (nearly all of them) without a call
        key, pos = (key, pos + 1) if key < 0x80 else _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value, pos
            continue
        if wire == 2:
            size, pos = (buf[pos], pos + 1) if pos < end and buf[pos] < 0x80 else _varint(buf, pos, end)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if size > end - pos:
            raise ValueError(f"field {field} claims {size} bytes, {end - pos} are left")
        yield field, wire, pos, pos + size
        pos += size


def _list_field(buf: bytes, kind: int, wire: int, a: int, b: int, out: np.ndarray | None, i: int) -> int:
    """How many values one field (``wire``, ``buf[a:b]``; a varint's value in ``a``) of a BytesList, FloatList or
    Int64List holds, packed or not; written to ``out[i:]`` when ``out`` is given."""
    if kind == _FLOATS and wire in (2, 5):
        n, rest = divmod(b - a, 4)
        if rest:
            raise ValueError("a packed float list's length is not a multiple of 4")
        if out is not None:
            out.view("<u4")[i : i + n] = np.frombuffer(buf, "<u4", n, a)  # the bits as written, NaNs included
        return n
    if kind == _INTS and wire == 2:  # packed varints: one value per byte below 0x80
        if out is None:
            return int(np.count_nonzero(np.frombuffer(buf, np.uint8, b - a, a) < 0x80))
        n = 0
        while a < b:
            v, a = _varint(buf, a, b)
            out[i + n] = v - (1 << 64) if v >> 63 else v
            n += 1
        return n
    if kind == _INTS and wire == 0:
        if out is not None:
            out[i] = a - (1 << 64) if a >> 63 else a
        return 1
    if kind == _BYTES and wire == 2:
        if out is not None:
            out[i] = a, b
        return 1
    raise ValueError(f"a {KINDS[kind]} list holds a field of wire type {wire}")


def _list_values(buf: bytes, kind: int, a: int, b: int) -> np.ndarray:
    """The values of a BytesList, FloatList or Int64List in ``buf[a:b]`` (see :data:`Feature`): every field 1 in
    order, unknown fields skipped.  Counted first, then written into one array: at most 8 bytes per value (16
    per bytes value), each of which takes at least one byte (two) of the record."""
    n = 0
    for f, w, s, e in _fields(buf, a, b):
        if f == 1:
            n += _list_field(buf, kind, w, s, e, None, 0)
    out = np.empty((n, 2) if kind == _BYTES else n, "<f4" if kind == _FLOATS else "<i8")
    i = 0
    for f, w, s, e in _fields(buf, a, b):
        if f == 1:
            i += _list_field(buf, kind, w, s, e, out, i)
    return out


def _entries(buf: bytes) -> Iterator[tuple[int, int, int, int]]:
    """``(name start, name stop, Feature start, Feature stop)`` of each entry of the Example's feature map, in
    order (a later entry of the same name replaces an earlier one, as protobuf merges maps)."""
    for f, w, a, b in _fields(buf, 0, len(buf)):
        if f != 1 or w != 2:
            continue  # Example.features is field 1
        for f2, w2, a2, b2 in _fields(buf, a, b):
            if f2 != 1 or w2 != 2:
                continue  # Features.feature (map entries) is field 1
            name = value = (a2, a2)  # absent: "" and an empty Feature
            for f3, w3, a3, b3 in _fields(buf, a2, b2):
                if w3 == 2 and f3 == 1:
                    name = (a3, b3)
                elif w3 == 2 and f3 == 2:
                    value = (a3, b3)
            yield (*name, *value)


def parse_example(buf: bytes, wanted: Collection[str]) -> dict[str, Feature]:
    """The features named in ``wanted`` of a serialized ``tf.train.Example`` (those it has), as
    ``(kind, values)``: ``kind`` ``"bytes"``, ``"float"``, ``"int64"`` or ``"empty"`` (a Feature of no list).

    Raises:
        ValueError: the bytes are no well-formed Example (a varint cut short or above 2**64, a length past the
            end, a list field of another type).
    """
    keys = {name.encode(): name for name in wanted}
    out: dict[str, Feature] = {}
    for n0, n1, a, b in _entries(buf):
        name = keys.get(buf[n0:n1])
        if name is None:
            continue
        kind, values = "empty", np.zeros(0, "<f4")
        for f, w, s, e in _fields(buf, a, b):  # a oneof: the last list given wins
            if f in KINDS and w == 2:
                kind, values = KINDS[f], _list_values(buf, f, s, e)
        out[name] = (kind, values)
    return out


def feature_names(buf: bytes, limit: int) -> tuple[list[str], int]:
    """The first ``limit`` feature names of a serialized Example (for messages), and how many it has."""
    names: list[str] = []
    n = 0
    for n0, n1, _, _ in _entries(buf):
        n += 1
        if len(names) < limit:
            names.append(buf[n0:n1].decode("utf-8", "replace"))
    return names, n
