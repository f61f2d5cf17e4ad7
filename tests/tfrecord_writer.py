"""TFRecord shards for the tests, written without TensorFlow: ``tf.train.Example`` messages encoded by hand and
framed as lmdbstore's reader (``lmdbstore.ingestion.sources.tfrecord_io``) and TensorFlow read them."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from lmdbstore.ingestion.sources.tfrecord_io import KINDS, crc32c_module, masked_crc

#: Feature's oneof fields (BytesList, FloatList, Int64List), as the reader numbers them.
_BYTES, _FLOATS, _INTS = ({v: k for k, v in KINDS.items()}[kind] for kind in ("bytes", "float", "int64"))


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
