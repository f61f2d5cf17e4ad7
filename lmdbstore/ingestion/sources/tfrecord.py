"""TFRecord sources (``.tfrecord``/``.tfrecords``, and TensorFlow's shard names ``NAME.tfrecord-00003-of-00016``):
one ``tf.train.Example`` per sample, read without TensorFlow (:mod:`~lmdbstore.ingestion.sources.tfrecord_io`).

Each record holds the sample in feature ``x_key`` and its label in ``y_key``:

* the sample as ``bytes`` (its raw little-endian values: ``x.tobytes()``), read as ``dtype`` -- which bytes
  cannot tell, so it must be given -- in ``sample_shape`` (default: 1-D); or as a float list (float32) or an
  int64 list, in ``sample_shape`` (default: 1-D of the list's length);
* the label as an int64 list of one class id, or a bytes list of one class name (UTF-8); ``label=`` labels
  every sample instead.

Every record of a file must have the same kinds and sizes as its first.  Each file is one source, so a
directory of shards resumes file by file (the resume ledger has an entry per shard).  Opening a file walks its
record headers once (12 bytes each: the count, every length's crc32c, a cut last record); reading checks every
record's data crc32c.  A damaged record is one :class:`~lmdbstore.errors.SourceError` line naming the file and
the record, a record of another layout a :class:`~lmdbstore.errors.ValidationError` line.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import SourceError, ValidationError
from lmdbstore.format.dtypes import normalize_dtype
from lmdbstore.format.limits import MAX_CLASS_NAME_CHARS
from lmdbstore.ingestion.sources.base import FileSource, const_labels
from lmdbstore.ingestion.sources.checks import READ_ERRORS, Label, check_range, one_line, stat_file
from lmdbstore.ingestion.sources.tfrecord_io import (
    FOOTER_BYTES,
    HEADER_BYTES,
    crc32c_module,
    masked_crc,
    parse_example,
    read_header,
)

__all__ = ["TFRecordSource", "is_tfrecord_name"]

#: File names TFRecord files go by: ``*.tfrecord``, ``*.tfrecords`` and TensorFlow's ``*.tfrecord-00003-of-00016``.
_TFRECORD_NAME = re.compile(r"\.tfrecords?(-\d+-of-\d+)?$", re.IGNORECASE)
#: Read buffer of a TFRecord file (records are read one by one; the buffer makes that a few large reads).
_BUFFER = 1 << 20


def is_tfrecord_name(name: str) -> bool:
    """Whether a file name is one of a TFRecord file (see :data:`_TFRECORD_NAME`)."""
    return _TFRECORD_NAME.search(name) is not None


class TFRecordSource(FileSource):
    """A TFRecord file of ``tf.train.Example`` records: sample feature ``x_key``, label feature ``y_key`` (or
    ``label``); ``dtype`` (for a bytes sample feature) and ``sample_shape`` say how to read the samples."""

    kind = "tfrecord"
    _key_options = ("x_key", "y_key", "bytes_dtype", "sample_shape")
    _member_word = "feature"

    def __init__(
        self,
        path: Path,
        *,
        label: Label | None,
        x_key: str,
        y_key: str,
        dtype: Any = None,
        sample_shape: tuple[int, ...] | None = None,
    ) -> None:
        self._stat = stat_file(path)
        self.path, self.label, self.x_key, self.y_key = path, label, x_key, y_key
        self.name = f"{path}[{x_key}]"
        self.bytes_dtype = normalize_dtype(dtype) if dtype is not None else None
        self.sample_shape = list(sample_shape) if sample_shape is not None else None
        crc = crc32c_module(path)  # before anything: a missing package is one line
        self._n = self._count(crc)
        if self._n == 0:
            raise SourceError("the TFRecord file holds no records", path=path)
        first = self._first_record(crc)
        self._x_kind, self.shape, self.dtype = self._sample_layout(first)
        self._y_kind = self._label_kind(first) if label is None else None

    # ------------------------------------------------------------------------------------------ opening
    def _open(self) -> Any:
        try:
            return open(self.path, "rb", buffering=_BUFFER)
        except OSError as exc:
            raise SourceError(f"cannot open ({one_line(exc)})", path=self.path) from exc

    def _count(self, crc: Any) -> int:
        """The number of records, walking their headers (each length's crc checked; the file must end where
        the last record does)."""
        size, at, n = self._stat.st_size, 0, 0
        with self._open() as f:
            while True:
                length = self._header(f, crc, at, n)
                if length is None:
                    return n
                at += HEADER_BYTES + length + FOOTER_BYTES
                if at > size:
                    raise SourceError(
                        f"record {n} is cut short: it claims {length} bytes of data, the file ends first",
                        path=self.path,
                    )
                f.seek(at)
                n += 1

    def _header(self, f: Any, crc: Any, at: int, index: int) -> int | None:
        try:
            return read_header(f, crc, at, index, self.path)
        except READ_ERRORS as exc:
            raise SourceError(f"read failed at record {index} ({one_line(exc)})", path=self.path) from exc

    def _first_record(self, crc: Any) -> dict[str, Any]:
        with self._open() as f:
            return next(self._records(f, crc, 0, 1, every=True))[1]  # every feature: messages list them

    def _sample_layout(self, first: dict[str, Any]) -> tuple[str, tuple[int, ...], np.dtype[Any]]:
        """The sample feature's kind, and the samples' shape and dtype, from the first record."""
        if self.x_key not in first:
            raise SourceError(
                f"record 0 has no feature {self.x_key!r}; it has: {', '.join(sorted(first)) or 'none'}",
                path=self.path,
                hint="choose the sample feature with x_key=",
            )
        kind, value = first[self.x_key]
        if kind == "bytes":
            if self.bytes_dtype is None:
                raise SourceError(
                    f"feature {self.x_key!r} holds bytes, whose dtype a TFRecord does not record",
                    path=self.path,
                    hint="give the samples' dtype= (and their sample_shape=)",
                )
            dtype = np.dtype(self.bytes_dtype).newbyteorder("<")
            nbytes = len(value[0]) if len(value) == 1 else -1
            if nbytes < 0 or nbytes % dtype.itemsize:
                raise SourceError(
                    f"record 0: feature {self.x_key!r} is not one bytes value of whole {dtype} elements",
                    path=self.path,
                )
            count = nbytes // dtype.itemsize
        else:
            dtype = np.dtype("<f4" if kind == "float" else "<i8")
            count = len(value)
            if self.bytes_dtype is not None and normalize_dtype(self.bytes_dtype) != normalize_dtype(dtype):
                raise SourceError(
                    f"feature {self.x_key!r} is a {kind} list ({dtype.name}); dtype= applies to bytes features",
                    path=self.path,
                    hint="leave dtype= out (a store of another dtype: cast=True converts)",
                )
        shape = tuple(self.sample_shape) if self.sample_shape is not None else (count,)
        if math.prod(shape) != count or count == 0:
            raise SourceError(
                f"record 0: feature {self.x_key!r} holds {count} values, sample_shape {shape} needs {math.prod(shape)}",
                path=self.path,
                hint="give the samples' sample_shape=",
            )
        return kind, shape, dtype

    def _label_kind(self, first: dict[str, Any]) -> str:
        if self.y_key not in first:
            raise SourceError(
                f"record 0 has no feature {self.y_key!r}; it has: {', '.join(sorted(first)) or 'none'}",
                path=self.path,
                hint="choose the label feature with y_key=, or label every sample with label=CLASS",
            )
        kind, value = first[self.y_key]
        if kind == "float" or len(value) != 1:
            raise SourceError(
                f"record 0: label feature {self.y_key!r} must be one int64 class id or one bytes class name, "
                f"got {len(value)} {kind} value(s)",
                path=self.path,
            )
        return str(kind)

    # ------------------------------------------------------------------------------------------ reading
    def _records(
        self, f: Any, crc: Any, start: int, stop: int, every: bool = False
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, features)`` of records ``start..stop-1`` (``f`` at the file's start), every crc checked;
        only the sample and label features unless ``every``."""
        wanted = None if every else (self.x_key,) if self.label is not None else (self.x_key, self.y_key)
        at = 0
        for i in range(stop):
            length = self._header(f, crc, at, i)
            if length is None:
                raise SourceError(f"the file ends before record {i}; was it changed while read?", path=self.path)
            if i < start:
                at += HEADER_BYTES + length + FOOTER_BYTES
                f.seek(at)
                continue
            body = f.read(length + FOOTER_BYTES)
            if len(body) != length + FOOTER_BYTES:
                raise SourceError(f"record {i} is cut short", path=self.path)
            data = body[:length]
            if masked_crc(crc.value(data)) != struct.unpack("<I", body[length:])[0]:
                raise SourceError(f"record {i} is damaged: the crc32c of its data does not match", path=self.path)
            try:
                feats = parse_example(data, wanted)
            except (ValueError, UnicodeDecodeError) as exc:
                raise SourceError(f"record {i} is no tf.train.Example ({exc})", path=self.path) from exc
            at += HEADER_BYTES + length + FOOTER_BYTES
            yield i, feats

    def _sample(self, feats: dict[str, Any], i: int) -> np.ndarray:
        got = feats.get(self.x_key)
        if got is None:
            raise ValidationError(f"record {i} has no feature {self.x_key!r}", path=self.path)
        kind, value = got
        if kind != self._x_kind:
            raise ValidationError(
                f"record {i}: feature {self.x_key!r} is a {kind} list, record 0's a {self._x_kind} list", path=self.path
            )
        if kind == "bytes":
            if len(value) != 1 or len(value[0]) != self.dtype.itemsize * math.prod(self.shape):
                have = sum(len(v) for v in value)
                raise ValidationError(
                    f"record {i}: feature {self.x_key!r} holds {have} bytes, {self.dtype.itemsize * math.prod(self.shape)} "
                    f"expected ({self.dtype} {self.shape})",
                    path=self.path,
                )
            return np.frombuffer(value[0], self.dtype)
        if len(value) != math.prod(self.shape):
            raise ValidationError(
                f"record {i}: feature {self.x_key!r} holds {len(value)} values, {math.prod(self.shape)} expected",
                path=self.path,
            )
        return np.asarray(value)

    def _label(self, feats: dict[str, Any], i: int) -> int | str:
        got = feats.get(self.y_key)
        if got is None or got[0] != self._y_kind or len(got[1]) != 1:
            what = "no" if got is None else f"{len(got[1])} {got[0]} value(s) of"
            raise ValidationError(
                f"record {i} has {what} label feature {self.y_key!r}; one {self._y_kind} value expected", path=self.path
            )
        value = got[1][0]
        if self._y_kind == "int64":
            return int(value)
        if len(value) > 4 * MAX_CLASS_NAME_CHARS:
            raise ValidationError(f"record {i}: its class name is longer than {MAX_CLASS_NAME_CHARS}", path=self.path)
        try:
            return str(value.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValidationError(f"record {i}: its class name is not UTF-8", path=self.path) from exc

    def _batches(self, batch: int, start: int, with_x: bool) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        check_range(batch, start, self._n)
        crc = crc32c_module(self.path)
        with self._open() as f:
            records = self._records(f, crc, start, self._n)
            for a in range(start, self._n, batch):
                k = min(batch, self._n - a)
                x = np.empty((k, *self.shape), self.dtype) if with_x else None
                labels: list[Any] = []
                for j in range(k):
                    i, feats = next(records)
                    if x is not None:
                        x[j] = self._sample(feats, i).reshape(self.shape)
                    if self.label is None:
                        labels.append(self._label(feats, i))
                if self.label is not None:
                    y = const_labels(self.label, k)
                else:
                    y = np.asarray(labels, np.int64) if self._y_kind == "int64" else np.asarray(labels, dtype=str)
                    y = self._labels(y, a)
                yield x, y

    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for x, y in self._batches(batch, start, with_x=True):
            assert x is not None
            yield x, y

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        for _, y in self._batches(batch, start, with_x=False):
            yield y
