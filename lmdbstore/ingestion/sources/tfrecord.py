"""TFRecord sources (``.tfrecord``/``.tfrecords``, and TensorFlow's shard names ``NAME.tfrecord-00003-of-00016``):
one ``tf.train.Example`` per sample, read without TensorFlow (:mod:`~lmdbstore.ingestion.sources.tfrecord_io`).

Each record holds the sample in feature ``x_key`` and its label in ``y_key``:

* the sample as ``bytes`` (its raw values: ``x.tobytes()``), read as ``dtype`` -- which bytes cannot tell, so it
  must be given, byte order included (``">f4"``: big-endian, stored little-endian) -- in ``sample_shape``
  (default: 1-D); or as a float list (float32) or an int64 list, in ``sample_shape`` (default: 1-D of the list's
  length);
* the label as an int64 list of one class id, or a bytes list of one class name (UTF-8); ``label=`` labels
  every sample instead.

Every record of a file must have the same kinds and sizes as its first.  Each file is one source (a directory
of shards resumes file by file).  Opening a file walks the records' headers, reading checks every record's
crc32c: a damaged record is a :class:`~lmdbstore.errors.SourceError` naming the file and the record, a record of
another layout a :class:`~lmdbstore.errors.ValidationError`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import PREVIEW_ITEMS, SourceError, ValidationError, preview
from lmdbstore.format.dtypes import normalize_dtype
from lmdbstore.format.limits import MAX_CLASS_NAME_CHARS
from lmdbstore.ingestion.sources.base import FileSource, const_labels
from lmdbstore.ingestion.sources.checks import Label, check_range, stat_file
from lmdbstore.ingestion.sources.tfrecord_io import (
    Feature,
    RecordFile,
    crc32c_module,
    feature_names,
    parse_example,
)

__all__ = ["TFRecordSource", "is_tfrecord_name"]

#: File names TFRecord files go by: ``*.tfrecord``, ``*.tfrecords`` and TensorFlow's ``*.tfrecord-00003-of-00016``.
_TFRECORD_NAME = re.compile(r"\.tfrecords?(-\d+-of-\d+)?$", re.IGNORECASE)


def is_tfrecord_name(name: str) -> bool:
    """Whether a file name is one of a TFRecord file (see :data:`_TFRECORD_NAME`)."""
    return _TFRECORD_NAME.search(name) is not None


def _what(kind: str) -> str:
    return "an empty feature" if kind == "empty" else f"a {kind} list"


class TFRecordSource(FileSource):
    """A TFRecord file of ``tf.train.Example`` records: sample feature ``x_key``, label feature ``y_key`` (or
    ``label``); ``dtype``, ``sample_shape`` and ``compression`` as :func:`~lmdbstore.ingestion.sources.open_source`."""

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
        compression: str | None = None,
    ) -> None:
        self._stat = stat_file(path)
        self.path, self.label, self.x_key, self.y_key = path, label, x_key, y_key
        self.name = f"{path}[{x_key}]"
        if dtype is not None:
            normalize_dtype(dtype)  # refuses a dtype no store holds
        self.bytes_dtype = np.dtype(dtype).str if dtype is not None else None  # its byte order kept: it is read so
        self.sample_shape = list(sample_shape) if sample_shape is not None else None
        with RecordFile(path, compression, crc32c_module(path)) as f:  # the package first: if missing, one line
            self.compression, first = f.compression, f.next()
            if first is None:
                raise SourceError("the TFRecord file holds no records", path=path)
            while f.next(keep=False) is not None:
                pass
            self._n = f.index
        feats = self._parse(first, 0)
        self._x_kind, self.shape, self.dtype = self._sample_layout(first, feats)
        self._y_kind = self._label_kind(first, feats) if label is None else None

    # ------------------------------------------------------------------------------------------ opening
    def _parse(self, data: bytes, i: int) -> dict[str, Feature]:
        wanted: Collection[str] = (self.x_key,) if self.label is not None else (self.x_key, self.y_key)
        try:
            return parse_example(data, wanted)
        except ValueError as exc:
            raise SourceError(f"record {i} is no tf.train.Example ({exc})", path=self.path) from exc

    def _missing(self, first: bytes, key: str, hint: str) -> SourceError:
        names, n = feature_names(first, PREVIEW_ITEMS)
        has = preview(sorted(names), total=n) or "none"
        return SourceError(f"record 0 has no feature {key!r}; it has: {has}", path=self.path, hint=hint)

    def _sample_layout(self, first: bytes, feats: dict[str, Feature]) -> tuple[str, tuple[int, ...], np.dtype[Any]]:
        """The sample feature's kind, and the samples' shape and dtype, from the first record."""
        if self.x_key not in feats:
            raise self._missing(first, self.x_key, "choose the sample feature with x_key=")
        kind, value = feats[self.x_key]
        if kind == "bytes":
            if self.bytes_dtype is None:
                raise SourceError(
                    f"feature {self.x_key!r} holds bytes, whose dtype a TFRecord does not record",
                    path=self.path,
                    hint="give the samples' dtype= (and their sample_shape=)",
                )
            dtype = np.dtype(self.bytes_dtype)
            nbytes = int(value[0, 1] - value[0, 0]) if len(value) == 1 else -1
            if nbytes < 0 or nbytes % dtype.itemsize:
                raise SourceError(
                    f"record 0: feature {self.x_key!r} is not one bytes value of whole {dtype} elements",
                    path=self.path,
                )
            count = nbytes // dtype.itemsize
        else:
            dtype = np.dtype("<i8" if kind == "int64" else "<f4")
            count = len(value)
            if self.bytes_dtype is not None and normalize_dtype(self.bytes_dtype) != normalize_dtype(dtype):
                raise SourceError(
                    f"feature {self.x_key!r} is {_what(kind)} ({dtype.name}); dtype= applies to bytes features",
                    path=self.path,
                    hint="leave dtype= out (a store of another dtype: cast=True converts)",
                )
        shape = tuple(self.sample_shape) if self.sample_shape is not None else (count,)
        if math.prod(shape) != count or count == 0:
            raise SourceError(
                f"record 0: feature {self.x_key!r} holds {count} values"
                + (f", sample_shape {shape} needs {math.prod(shape)}" if count else ""),
                path=self.path,
                hint="give the samples' sample_shape=",
            )
        return kind, shape, dtype

    def _label_kind(self, first: bytes, feats: dict[str, Feature]) -> str:
        if self.y_key not in feats:
            raise self._missing(
                first, self.y_key, "choose the label feature with y_key=, or label every sample with label=CLASS"
            )
        kind, value = feats[self.y_key]
        if kind not in ("int64", "bytes") or len(value) != 1:
            raise SourceError(
                f"record 0: label feature {self.y_key!r} must be one int64 class id or one bytes class name, "
                f"got {len(value)} {kind} value(s)",
                path=self.path,
            )
        return kind

    # ------------------------------------------------------------------------------------------ reading
    def _records(self, start: int) -> Generator[tuple[int, bytes, dict[str, Feature]]]:
        """``(index, data, features)`` of records ``start..`` in order, every crc checked."""
        with RecordFile(self.path, self.compression, crc32c_module(self.path)) as f:
            for i in range(self._n):
                data = f.next(keep=i >= start)
                if data is None:
                    raise SourceError(f"the file ends before record {i}; was it changed while read?", path=self.path)
                if i >= start:
                    yield i, data, self._parse(data, i)

    def _sample(self, data: bytes, feats: dict[str, Feature], i: int) -> np.ndarray:
        if self.x_key not in feats:
            raise ValidationError(f"record {i} has no feature {self.x_key!r}", path=self.path)
        kind, value = feats[self.x_key]
        if kind != self._x_kind:
            raise ValidationError(
                f"record {i}: feature {self.x_key!r} is {_what(kind)}, record 0's {_what(self._x_kind)}",
                path=self.path,
            )
        size = math.prod(self.shape)
        if kind != "bytes":
            if len(value) != size:
                raise ValidationError(
                    f"record {i}: feature {self.x_key!r} holds {len(value)} values, {size} expected", path=self.path
                )
            return value
        nbytes = self.dtype.itemsize * size
        if len(value) != 1 or value[0, 1] - value[0, 0] != nbytes:
            have = int((value[:, 1] - value[:, 0]).sum())
            raise ValidationError(
                f"record {i}: feature {self.x_key!r} holds {have} bytes, {nbytes} expected ({self.dtype} {self.shape})",
                path=self.path,
            )
        return np.frombuffer(data, self.dtype, size, int(value[0, 0]))

    def _label(self, data: bytes, feats: dict[str, Feature], i: int) -> int | str:
        kind, value = feats.get(self.y_key, ("", np.zeros(0)))
        if kind != self._y_kind or len(value) != 1:
            what = "no" if not kind else f"{len(value)} {kind} value(s) of"
            raise ValidationError(
                f"record {i} has {what} label feature {self.y_key!r}; one {self._y_kind} value expected", path=self.path
            )
        if kind == "int64":
            return int(value[0])
        a, b = int(value[0, 0]), int(value[0, 1])
        if b - a > 4 * MAX_CLASS_NAME_CHARS:
            raise ValidationError(f"record {i}: its class name is longer than {MAX_CLASS_NAME_CHARS}", path=self.path)
        try:
            return data[a:b].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError(f"record {i}: its class name is not UTF-8", path=self.path) from exc

    def _read(self, batch: int, start: int, with_x: bool) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        check_range(batch, start, self._n)
        records = self._records(start)
        for a in range(start, self._n, batch):
            k = min(batch, self._n - a)
            x = np.empty((k, *self.shape), self.dtype) if with_x else None
            labels: list[Any] = []
            for j in range(k):
                i, data, feats = next(records)
                if x is not None:
                    x[j] = self._sample(data, feats, i).reshape(self.shape)
                if self.label is None:
                    labels.append(self._label(data, feats, i))
            if self.label is not None:
                y = const_labels(self.label, k)
            else:  # names as Python strings: checked before numpy could drop a trailing NUL
                y = self._labels(np.array(labels, np.int64 if self._y_kind == "int64" else object), a)
            yield x, y
        records.close()
