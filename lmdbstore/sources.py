"""Ingest sources: the files samples come from, opened for streaming.

:func:`open_source` turns a path into one or more :class:`Source` objects, each a sequence of
``len(src)`` samples of ``src.shape`` and ``src.dtype`` with labels.  A source never loads its file
whole: :meth:`Source.iter_batches` reads ``batch`` rows at a time with plain ``readinto`` calls into
a fresh array (not ``mmap``: mapped pages count towards the process RSS, so streaming a 200 MB file
through a memory map would show 200 MB of resident memory).

Kinds (the path decides):

``.npy``
    A stack ``(N, *shape)`` (ndim >= 2).  Holds no labels, so ``label=CLASS`` is required.
``.npz``
    Sample array ``x_key`` (default ``"x"``), label array ``y_key`` (default ``"y"``: class ids or
    class names), optional ``class_names`` array.  The members are streamed straight from the zip
    (stored or deflated): ``np.load`` would decompress a whole member into memory.  When the archive
    has ``class_names`` and integer labels, the ids index ``class_names`` and the source yields names.
``.h5`` / ``.hdf5``
    Datasets ``h5_x`` and ``h5_y`` (defaults ``"x"``, ``"y"``), optional ``class_names`` dataset;
    needs the optional ``h5py`` dependency.
directory ``ROOT/<class>/*.npy``
    Each file one sample or a stack of samples, labelled by its subdirectory.  One source per class
    subdirectory (so the resume ledger has one entry per class, not per file); files in name order;
    tiny single-sample files are gathered into full batches.

``label=`` (a class name or class id) labels every sample of an ``.npy``, ``.npz`` or HDF5 source;
for ``.npz``/HDF5 it replaces the file's own label array, which then need not exist.

Before anything is written, :func:`scan_source` streams a source through the writer's own checks
(:func:`~lmdbstore.writer.check_samples`, :func:`~lmdbstore.writer.label_ids`) so bad data fails
up front with the file and the sample index named.  Every error is a one-line
:class:`~lmdbstore.errors.SourceError` (cannot read the file) or
:class:`~lmdbstore.errors.ValidationError` (readable, but the data is unacceptable).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import zipfile
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from numpy.lib import format as npformat

from .errors import SourceError, ValidationError
from .writer import check_samples, label_ids

__all__ = [
    "DirectoryClassSource",
    "H5Source",
    "NpySource",
    "NpzSource",
    "Source",
    "infer_classes",
    "open_source",
    "open_sources",
    "scan_source",
]

Label = str | int

NPY_SUFFIXES = (".npy",)
NPZ_SUFFIXES = (".npz",)
H5_SUFFIXES = (".h5", ".hdf5")
#: Name of the optional array/dataset listing the class names that integer labels index.
CLASS_NAMES_KEY = "class_names"
#: Largest single read; bounds the temporary copies a zip stream makes for one ``readinto``.
_READ_CHUNK = 16 << 20
#: Sample dtype kinds a source may hold (bool, ints, unsigned, floats).
_SAMPLE_KINDS = "biuf"
#: Bytes read to peek at a directory file's header (covers every header numpy writes for ndim <= 4).
_PEEK_BYTES = 4096
_NPY_MAGIC = b"\x93NUMPY"
#: Errors that mean "this file's bytes are bad or unreadable" while reading it.
_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, zipfile.BadZipFile)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------- .npy headers
@dataclass(frozen=True)
class _Header:
    """What an .npy header says: array shape, dtype, memory order, and where the data starts."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fortran: bool
    offset: int

    @property
    def data_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _read_header(fp: Any, path: str | Path, what: str = "the file") -> _Header:
    """Parse the .npy header at the current position of ``fp`` (a file or a zip member stream)."""
    try:
        version = npformat.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = npformat.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = npformat.read_array_header_2_0(fp)
        else:
            raise SourceError(f"{what} has unsupported .npy format version {version[0]}.{version[1]}", path=path)
        offset = fp.tell()
    except SourceError:
        raise
    except _READ_ERRORS as exc:
        raise SourceError(f"{what} is not a valid .npy array ({_one_line(exc)})", path=path) from exc
    return _Header(tuple(int(s) for s in shape), np.dtype(dtype), bool(fortran), int(offset))


def _check_sample_dtype(dtype: np.dtype[Any], path: str | Path, what: str) -> None:
    if dtype.hasobject:
        raise SourceError(
            f"{what} holds Python objects (dtype {dtype}); samples must be numeric",
            path=path,
            hint="save a numeric array",
        )
    if dtype.fields is not None or dtype.kind not in _SAMPLE_KINDS:
        raise SourceError(f"{what} has dtype {dtype}; samples must be numeric (bool, int or float)", path=path)


def _check_stack(h: _Header, path: str | Path, what: str) -> None:
    """An array of samples: numeric, (N, *shape) with ndim >= 2, N >= 1."""
    _check_sample_dtype(h.dtype, path, what)
    if len(h.shape) < 2:
        raise SourceError(
            f"{what} has shape {h.shape}; expected a stack of samples (N, *sample_shape) with ndim >= 2", path=path
        )
    if h.shape[0] == 0:
        raise SourceError(f"{what} holds no samples (shape {h.shape})", path=path)
    if math.prod(h.shape[1:]) == 0:
        raise SourceError(f"{what} has empty samples (shape {h.shape})", path=path)


def _check_size(h: _Header, have: int, path: str | Path, what: str) -> None:
    """The bytes present must be exactly header + data (a short file is truncated)."""
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
def _read_into(fp: Any, out: np.ndarray, path: str | Path, first: int) -> None:
    """Fill ``out`` (C-contiguous) from ``fp``; a short read is a truncated file."""
    mv = out.reshape(-1).view(np.uint8).data
    total, got = len(mv), 0
    try:
        while got < total:
            n = fp.readinto(mv[got : min(total, got + _READ_CHUNK)])
            if not n:
                break
            got += n
    except _READ_ERRORS as exc:
        raise SourceError(f"read failed ({_one_line(exc)})", path=path, key=first) from exc
    if got < total:
        row = out.nbytes // max(len(out), 1)
        raise SourceError("file ended early (truncated while reading)", path=path, key=first + got // max(row, 1))


def _pread_into(path: str, offset: int, mv: memoryview, first: int) -> None:
    """Read ``len(mv)`` bytes of file ``path`` at ``offset`` into ``mv`` (cheap for many tiny files)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            got = 0
            while got < len(mv):
                if hasattr(os, "preadv"):
                    n = os.preadv(fd, [mv[got:]], offset + got)
                else:  # pragma: no cover - platforms without preadv
                    chunk = os.pread(fd, len(mv) - got, offset + got)
                    n = len(chunk)
                    mv[got : got + n] = chunk
                if not n:
                    break
                got += n
        finally:
            os.close(fd)
    except OSError as exc:
        raise SourceError(f"read failed ({_one_line(exc)})", path=path, key=first) from exc
    if got < len(mv):
        raise SourceError("file ended early (truncated since it was opened)", path=path, key=first)


def _const_labels(label: Label, n: int) -> np.ndarray:
    if isinstance(label, str):
        return np.full(n, label)
    return np.full(n, label, np.int64)


def _check_range(batch: int, start: int, n: int) -> None:
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start <= n:
        raise ValueError(f"start must be an integer in 0..{n}, got {start!r}")


def _check_label(label: Any) -> Label | None:
    if label is None:
        return None
    if isinstance(label, bool) or not isinstance(label, (str, int, np.integer)):
        raise ValueError(f"label must be a class name (str) or class id (int), got {label!r}")
    if isinstance(label, str):
        if not label.strip():
            raise ValueError("label must not be an empty class name")
        return label
    if label < 0:
        raise ValueError(f"label must be a class id >= 0, got {label}")
    return int(label)


def _stat_file(path: Path) -> os.stat_result:
    """Stat a source file; refuse missing, non-regular and empty files."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SourceError("no such file or directory", path=path) from None
    except OSError as exc:
        raise SourceError(f"cannot access ({_one_line(exc)})", path=path) from exc
    if not path.is_file():
        raise SourceError("not a regular file", path=path)
    if st.st_size == 0:
        raise SourceError("file is empty (0 bytes)", path=path)
    return st


def _labels_dtype_ok(dtype: np.dtype[Any]) -> bool:
    return dtype.kind in "iuUS" and dtype.fields is None


def _names_to_list(arr: np.ndarray, path: Path, what: str) -> list[str]:
    if arr.ndim != 1 or arr.dtype.kind not in "US" or len(arr) == 0:
        raise SourceError(f"{what} must be a non-empty 1-D array of strings, got {arr.dtype} {arr.shape}", path=path)
    names = [str(s) for s in arr.astype(str).tolist()]
    if len(set(names)) != len(names) or any(not s for s in names):
        raise SourceError(f"{what} must hold distinct non-empty names", path=path)
    return names


def _ids_to_names(y: np.ndarray, names: list[str], path: Path, first: int) -> np.ndarray:
    """Map integer ids through the file's own ``class_names``; an id outside it is a ValidationError."""
    ids = y.astype(np.int64, copy=False)
    bad = (ids < 0) | (ids >= len(names))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValidationError(
            f"label {int(ids[i])} is outside the file's {CLASS_NAMES_KEY} (0..{len(names) - 1})",
            path=path,
            key=first + i,
        )
    return np.asarray(names)[ids]


def _as_label_array(y: np.ndarray) -> np.ndarray:
    """Labels as int64 ids or a str (``U``) array."""
    if y.dtype.kind in "US":
        return y.astype(str)
    return y.astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------------- the interface
class Source(ABC):
    """A readable sequence of samples with labels, streamed in batches.

    Attributes:
        path: the file (or, for a directory source, the class subdirectory).
        name: display name, e.g. ``"data.npz[x]"``.
        shape: per-sample shape.
        dtype: sample dtype as found in the file (byte order included).
        label: the ``label=`` option (``None`` when labels come from the file or directory).
    """

    kind: ClassVar[str] = ""
    path: Path
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    label: Label | None = None
    _n: int = 0
    #: the file's own ``class_names`` (npz, HDF5), which its integer labels index
    _names: list[str] | None = None

    def __len__(self) -> int:
        """Number of samples."""
        return self._n

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} n={self._n} shape={self.shape} dtype={self.dtype}>"

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What identifies this source's content: kind, resolved path, size, mtime_ns, keys, label option."""

    def fingerprint(self) -> str:
        """Stable id for the resume ledger; changes whenever :meth:`describe` does (e.g. the file changes).

        Bounded length (an LMDB key): ``kind:<sha256 prefix of describe()>:<file name>``.
        """
        blob = json.dumps(self.describe(), sort_keys=True, default=str).encode()
        digest = hashlib.sha256(blob).hexdigest()[:32]
        short = self.path.name.encode()[:100].decode(errors="ignore")
        return f"{self.kind}:{digest}:{short}"

    def class_names(self) -> list[str] | None:
        """Class names the source implies (a ``label=`` name, the file's ``class_names``, subdirectories) or None."""
        if self.label is None and self._names is not None:
            return list(self._names)
        return [self.label] if isinstance(self.label, str) else None

    @abstractmethod
    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(x, y)`` in order from sample ``start``: ``x`` of shape ``(n, *shape)`` in the file's dtype,
        ``y`` int64 class ids or a ``str`` array of class names.  Each ``x`` is a new array the caller may keep.

        Raises:
            ValueError: ``batch < 1`` or ``start`` outside ``0..len``.
            SourceError: the file cannot be read (truncated, corrupt, changed).
        """

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        """Yield only the labels, in the same batches as :meth:`iter_batches` (cheaper where possible)."""
        for _, y in self.iter_batches(batch, start):
            yield y

    def locate(self, index: int) -> tuple[Path, int]:
        """The file holding sample ``index`` of this source, and its index within that file."""
        return self.path, index


class NpySource(Source):
    """A ``.npy`` stack ``(N, *shape)``, all samples labelled ``label``."""

    kind = "npy"

    def __init__(self, path: Path, *, label: Label | None) -> None:
        st = _stat_file(path)
        if label is None:
            raise SourceError(
                "an .npy file holds no labels; say which class its samples belong to",
                path=path,
                hint="pass --label CLASS (label=)",
            )
        with open(path, "rb") as f:
            h = _read_header(f, path)
        _check_stack(h, path, "the array")
        _check_size(h, st.st_size, path, "the array")
        self.path, self.name, self.label = path, str(path), label
        self.shape, self.dtype, self._n = h.shape[1:], h.dtype, h.shape[0]
        self._header, self._stat = h, st

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": self._stat.st_size,
            "mtime_ns": self._stat.st_mtime_ns,
            "label": self.label,
        }

    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        _check_range(batch, start, self._n)
        assert self.label is not None
        h = self._header
        if h.fortran:
            yield from self._iter_fortran(batch, start)
            return
        row = h.data_bytes // self._n
        try:
            f = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed in the finally below
        except OSError as exc:
            raise SourceError(f"cannot open ({_one_line(exc)})", path=self.path) from exc
        try:
            f.seek(h.offset + start * row)
            for a in range(start, self._n, batch):
                x = np.empty((min(batch, self._n - a), *self.shape), self.dtype)
                _read_into(f, x, self.path, a)
                yield x, _const_labels(self.label, len(x))
        finally:
            f.close()

    def _iter_fortran(self, batch: int, start: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Fortran-order files store rows strided; read them through a memory map (rare case)."""
        assert self.label is not None
        try:
            mm = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except _READ_ERRORS as exc:
            raise SourceError(f"cannot map the array ({_one_line(exc)})", path=self.path) from exc
        for a in range(start, self._n, batch):
            x = np.ascontiguousarray(mm[a : a + batch])
            yield x, _const_labels(self.label, len(x))


class _ZipMember:
    """One ``.npy`` member of an ``.npz``: its header and a way to stream rows from it."""

    def __init__(self, zf: zipfile.ZipFile, member: str, path: Path, what: str) -> None:
        self.member, self.what = member, what
        try:
            info = zf.getinfo(member)
            with zf.open(info) as fp:
                self.header = _read_header(fp, path, what)
        except SourceError:
            raise
        except (*_READ_ERRORS, RuntimeError, NotImplementedError) as exc:
            raise SourceError(f"cannot read {what} ({_one_line(exc)})", path=path) from exc
        if self.header.dtype.hasobject:
            raise SourceError(f"{what} holds pickled Python objects; save a numeric or string array", path=path)
        if self.header.fortran:
            raise SourceError(f"{what} is stored in Fortran order; save it C-ordered", path=path)
        _check_size(self.header, info.file_size, path, what)

    def read_all(self, zf: zipfile.ZipFile, path: Path) -> np.ndarray:
        """Load the whole member (only for small arrays such as ``class_names``)."""
        try:
            with zf.open(self.member) as fp:
                return npformat.read_array(fp, allow_pickle=False)
        except (*_READ_ERRORS, RuntimeError) as exc:
            raise SourceError(f"cannot read {self.what} ({_one_line(exc)})", path=path) from exc

    def rows(self, zf: zipfile.ZipFile, path: Path, batch: int, start: int, n: int) -> Iterator[np.ndarray]:
        """Stream rows ``start..n`` of the member in arrays of ``batch`` rows."""
        h = self.header
        row = h.data_bytes // h.shape[0]
        try:
            fp = zf.open(self.member)
        except (*_READ_ERRORS, RuntimeError) as exc:
            raise SourceError(f"cannot open {self.what} ({_one_line(exc)})", path=path) from exc
        try:
            try:
                fp.seek(h.offset + start * row)
            except _READ_ERRORS as exc:
                raise SourceError(f"read failed in {self.what} ({_one_line(exc)})", path=path, key=start) from exc
            for a in range(start, n, batch):
                out = np.empty((min(batch, n - a), *h.shape[1:]), h.dtype)
                _read_into(fp, out, path, a)
                yield out
        finally:
            fp.close()


class NpzSource(Source):
    """An ``.npz`` archive: samples ``x_key``, labels ``y_key`` (or ``label``), optional ``class_names``."""

    kind = "npz"

    def __init__(self, path: Path, *, label: Label | None, x_key: str, y_key: str) -> None:
        self._stat = _stat_file(path)
        self.path, self.label, self.x_key, self.y_key = path, label, x_key, y_key
        self.name = f"{path}[{x_key}]"
        with self._open_zip() as zf:
            members = {n[:-4]: n for n in zf.namelist() if n.endswith(".npy")}
            present = ", ".join(sorted(members)) or "none"
            if x_key not in members:
                raise SourceError(
                    f"no array {x_key!r} in the archive; it holds: {present}", path=path, hint="choose one with --x-key"
                )
            self._x = _ZipMember(zf, members[x_key], path, f"array {x_key!r}")
            _check_stack(self._x.header, path, f"array {x_key!r}")
            self.shape, self.dtype, self._n = self._x.header.shape[1:], self._x.header.dtype, self._x.header.shape[0]
            self._y: _ZipMember | None = None
            if label is None:
                if y_key not in members:
                    raise SourceError(
                        f"no label array {y_key!r} in the archive; it holds: {present}",
                        path=path,
                        hint="choose one with --y-key or label all samples with --label CLASS",
                    )
                self._y = _ZipMember(zf, members[y_key], path, f"array {y_key!r}")
                yh = self._y.header
                if len(yh.shape) != 1 or not _labels_dtype_ok(yh.dtype):
                    raise SourceError(
                        f"label array {y_key!r} must be 1-D class ids or class names, got dtype {yh.dtype} shape {yh.shape}",
                        path=path,
                    )
                if yh.shape[0] != self._n:
                    raise SourceError(
                        f"array {x_key!r} has {self._n} samples but label array {y_key!r} has {yh.shape[0]}", path=path
                    )
            self._names: list[str] | None = None
            if CLASS_NAMES_KEY in members and CLASS_NAMES_KEY not in (x_key, y_key):
                m = _ZipMember(zf, members[CLASS_NAMES_KEY], path, f"array {CLASS_NAMES_KEY!r}")
                self._names = _names_to_list(m.read_all(zf, path), path, f"array {CLASS_NAMES_KEY!r}")

    def _open_zip(self) -> zipfile.ZipFile:
        try:
            return zipfile.ZipFile(self.path)
        except (*_READ_ERRORS, RuntimeError) as exc:
            raise SourceError(f"not a readable .npz (zip) archive ({_one_line(exc)})", path=self.path) from exc

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": self._stat.st_size,
            "mtime_ns": self._stat.st_mtime_ns,
            "x_key": self.x_key,
            "y_key": self.y_key,
            "label": self.label,
        }

    def _labels(self, y: np.ndarray, first: int) -> np.ndarray:
        if self._names is not None and y.dtype.kind in "iu":
            return _ids_to_names(y, self._names, self.path, first)
        return _as_label_array(y)

    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        _check_range(batch, start, self._n)
        with self._open_zip() as zf:
            xs = self._x.rows(zf, self.path, batch, start, self._n)
            if self._y is None:
                assert self.label is not None
                for x in xs:
                    yield x, _const_labels(self.label, len(x))
                return
            ys = self._y.rows(zf, self.path, batch, start, self._n)
            for a, x, y in zip(range(start, self._n, batch), xs, ys, strict=True):
                yield x, self._labels(y, a)

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        _check_range(batch, start, self._n)
        if self._y is None:
            assert self.label is not None
            for a in range(start, self._n, batch):
                yield _const_labels(self.label, min(batch, self._n - a))
            return
        with self._open_zip() as zf:
            for a, y in zip(
                range(start, self._n, batch), self._y.rows(zf, self.path, batch, start, self._n), strict=True
            ):
                yield self._labels(y, a)


def _import_h5py(path: Path) -> Any:
    try:
        import h5py
    except ImportError as exc:
        raise SourceError(
            "reading HDF5 needs the h5py package", path=path, hint="pip install 'lmdbstore[hdf5]'"
        ) from exc
    return h5py


def _h5_dataset_names(f: Any, limit: int = 20) -> str:
    names: list[str] = []

    def visit(name: str, obj: Any) -> None:
        if hasattr(obj, "shape") and len(names) < limit:
            names.append(name)

    f.visititems(visit)
    return ", ".join(names) or "none"


class H5Source(Source):
    """An HDF5 file: samples in dataset ``h5_x``, labels in ``h5_y`` (or ``label``), optional ``class_names``."""

    kind = "h5"

    def __init__(self, path: Path, *, label: Label | None, h5_x: str, h5_y: str) -> None:
        self._stat = _stat_file(path)
        self.path, self.label, self.h5_x, self.h5_y = path, label, h5_x, h5_y
        self.name = f"{path}[{h5_x}]"
        self._names: list[str] | None = None
        self._y_is_str = False
        with self._open() as f:
            x = self._dataset(f, h5_x, "samples", "--h5-x")
            _check_stack(_Header(tuple(x.shape), np.dtype(x.dtype), False, 0), path, f"dataset {h5_x!r}")
            self.shape, self.dtype, self._n = tuple(int(s) for s in x.shape[1:]), np.dtype(x.dtype), int(x.shape[0])
            if label is None:
                y = self._dataset(f, h5_y, "labels", "--h5-y or label all samples with --label CLASS")
                self._y_is_str = self._h5py.check_string_dtype(y.dtype) is not None
                if y.ndim != 1 or not (self._y_is_str or _labels_dtype_ok(np.dtype(y.dtype))):
                    raise SourceError(
                        f"label dataset {h5_y!r} must be 1-D class ids or class names, got dtype {y.dtype} shape {y.shape}",
                        path=path,
                    )
                if y.shape[0] != self._n:
                    raise SourceError(
                        f"dataset {h5_x!r} has {self._n} samples but label dataset {h5_y!r} has {y.shape[0]}", path=path
                    )
            names = f.get(CLASS_NAMES_KEY)
            if names is not None and hasattr(names, "shape") and CLASS_NAMES_KEY not in (h5_x, h5_y):
                try:
                    arr = np.asarray(names.asstr()[()] if names.dtype.kind in "OS" else names[()])
                except (*_READ_ERRORS, TypeError) as exc:
                    raise SourceError(f"cannot read dataset {CLASS_NAMES_KEY!r} ({_one_line(exc)})", path=path) from exc
                self._names = _names_to_list(arr.astype(str), path, f"dataset {CLASS_NAMES_KEY!r}")

    def _open(self) -> Any:
        self._h5py = _import_h5py(self.path)
        try:
            return self._h5py.File(self.path, "r")
        except (OSError, ValueError) as exc:
            raise SourceError(f"not a readable HDF5 file ({_one_line(exc)})", path=self.path) from exc

    def _dataset(self, f: Any, key: str, what: str, option: str) -> Any:
        ds = f.get(key)
        if ds is None or not hasattr(ds, "shape"):
            raise SourceError(
                f"no {what} dataset {key!r} in the file; it holds: {_h5_dataset_names(f)}",
                path=self.path,
                hint=f"choose one with {option}",
            )
        return ds

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": self._stat.st_size,
            "mtime_ns": self._stat.st_mtime_ns,
            "h5_x": self.h5_x,
            "h5_y": self.h5_y,
            "label": self.label,
        }

    def _read_labels(self, y: Any, a: int, b: int) -> np.ndarray:
        arr = np.asarray(y.asstr()[a:b], dtype=str) if self._y_is_str else np.asarray(y[a:b])
        if self._names is not None and arr.dtype.kind in "iu":
            return _ids_to_names(arr, self._names, self.path, a)
        return _as_label_array(arr)

    def _slices(self, batch: int, start: int, with_x: bool) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        _check_range(batch, start, self._n)
        with self._open() as f:
            x, y = f[self.h5_x], (f[self.h5_y] if self.label is None else None)
            for a in range(start, self._n, batch):
                b = min(a + batch, self._n)
                try:
                    xb = np.ascontiguousarray(x[a:b]) if with_x else None
                    yb = _const_labels(self.label, b - a) if y is None else self._read_labels(y, a, b)  # type: ignore[arg-type]
                except (*_READ_ERRORS, RuntimeError, KeyError) as exc:
                    raise SourceError(f"read failed ({_one_line(exc)})", path=self.path, key=a) from exc
                yield xb, yb

    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for x, y in self._slices(batch, start, with_x=True):
            assert x is not None
            yield x, y

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        for _, y in self._slices(batch, start, with_x=False):
            yield y


# ---------------------------------------------------------------------------------------------- directories
class _HeaderCache:
    """Parses directory-file headers, reusing the parse for byte-identical headers (tiny files share one)."""

    def __init__(self) -> None:
        self._parsed: dict[bytes, _Header] = {}

    def read(self, path: str) -> _Header:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                head = os.read(fd, _PEEK_BYTES)
            finally:
                os.close(fd)
        except OSError as exc:
            raise SourceError(f"cannot read ({_one_line(exc)})", path=path) from exc
        key = self._header_bytes(head)
        if key is not None and key in self._parsed:
            return self._parsed[key]
        if key is None and len(head) == _PEEK_BYTES:  # huge header: parse from the file itself
            with open(path, "rb") as f:
                return _read_header(f, path)
        h = _read_header(io.BytesIO(head), path)
        if key is not None:
            self._parsed[key] = h
        return h

    @staticmethod
    def _header_bytes(head: bytes) -> bytes | None:
        """The complete header (magic..padding) if ``head`` holds it, else None."""
        if len(head) < 10 or head[:6] != _NPY_MAGIC:
            return None
        if head[6] == 1:
            end = 10 + struct.unpack("<H", head[8:10])[0]
        elif len(head) >= 12:
            end = 12 + struct.unpack("<I", head[8:12])[0]
        else:
            return None
        return head[:end] if end <= len(head) else None


@dataclass
class _DirFile:
    path: str
    header: _Header
    size: int
    mtime_ns: int


def _scan_class_dir(d: Path) -> list[tuple[str, str, int, int]]:
    """(name, path, size, mtime_ns) of the ``*.npy`` files directly in ``d``, sorted by name.

    Plain strings, not ``Path`` objects: a class may hold millions of tiny files.
    """
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                if e.name.endswith(".npy") and not e.name.startswith(".") and e.is_file():
                    st = e.stat()
                    out.append((e.name, e.path, st.st_size, st.st_mtime_ns))
    except OSError as exc:
        raise SourceError(f"cannot list ({_one_line(exc)})", path=d) from exc
    out.sort()
    return out


def _rel(path: str) -> str:
    """``class/file.npy``: how a directory file is named next to another one in a message."""
    return "/".join(path.split(os.sep)[-2:])


def _decide_sample_shape(files: list[_DirFile], sample_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """Per-sample shape of a directory: given, or the shape of the lowest-ndim files.

    With every file of the same ndim: equal shapes mean one sample per file, shapes that differ only
    in the first axis mean stacks.  Otherwise files of the lowest ndim are single samples and files
    one dimension higher are stacks of them.  Pass ``sample_shape`` to settle the ambiguous case of
    equally sized stacks.
    """
    if sample_shape is not None:
        return sample_shape
    shapes = [f.header.shape for f in files]
    first = shapes[0]
    dmin, dmax = min(map(len, shapes)), max(map(len, shapes))
    if dmin == dmax:
        if all(s == first for s in shapes):
            return first
        if dmin >= 2 and all(s[1:] == first[1:] for s in shapes):
            return first[1:]
        bad = next(f for f in files if f.header.shape != first)
        raise SourceError(
            f"file has shape {bad.header.shape} but {_rel(files[0].path)} has {first}; the samples must agree",
            path=bad.path,
        )
    return next(s for s in shapes if len(s) == dmin)


def _open_directory(root: Path, label: Label | None, sample_shape: tuple[int, ...] | None) -> list[Source]:
    if label is not None:
        raise SourceError(
            "label= does not apply to a directory; its labels are the class subdirectory names", path=root
        )
    try:
        class_dirs = sorted(
            (e for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")), key=lambda e: e.name
        )
    except OSError as exc:
        raise SourceError(f"cannot list ({_one_line(exc)})", path=root) from exc
    if not class_dirs:
        raise SourceError(
            "directory has no class subdirectories", path=root, hint="lay it out as ROOT/<class_name>/*.npy"
        )
    names = [e.name for e in class_dirs]
    cache = _HeaderCache()
    per_class: list[tuple[str, list[_DirFile]]] = []
    for name in names:
        files = []
        for _, p, size, mtime in _scan_class_dir(root / name):
            if size == 0:
                raise SourceError("file is empty (0 bytes)", path=p)
            h = cache.read(p)
            _check_sample_dtype(h.dtype, p, "the array")
            if len(h.shape) == 0 or math.prod(h.shape) == 0:
                raise SourceError(f"the array has shape {h.shape}; expected a sample or a stack of samples", path=p)
            if h.fortran and len(h.shape) > 1:
                raise SourceError("the array is stored in Fortran order; save it C-ordered", path=p)
            _check_size(h, size, p, "the array")
            files.append(_DirFile(p, h, size, mtime))
        if files:
            per_class.append((name, files))
    if not per_class:
        raise SourceError(
            "no .npy files in the class subdirectories", path=root, hint="expected ROOT/<class_name>/*.npy"
        )
    all_files = [f for _, fs in per_class for f in fs]
    shape = _decide_sample_shape(all_files, sample_shape)
    dtype = all_files[0].header.dtype
    for f in all_files:
        s = f.header.shape
        if s != shape and (len(s) != len(shape) + 1 or s[1:] != shape):
            raise SourceError(f"file has shape {s}; expected one sample {shape} or a stack (N, *{shape})", path=f.path)
        if f.header.dtype != dtype:
            raise SourceError(
                f"file has dtype {f.header.dtype} but {_rel(all_files[0].path)} has {dtype}; the samples must agree",
                path=f.path,
            )
    return [DirectoryClassSource(root, name, files, shape, dtype, names) for name, files in per_class]


class DirectoryClassSource(Source):
    """The ``*.npy`` files of one class subdirectory ``ROOT/<class>/``, gathered into batches."""

    kind = "dir"

    def __init__(
        self,
        root: Path,
        class_name: str,
        files: list[_DirFile],
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        all_names: list[str],
    ) -> None:
        self.root, self.class_name = root, class_name
        self.path = root / class_name
        self.name = f"{self.path}/*.npy"
        self.shape, self.dtype = shape, dtype
        self._all_names = list(all_names)
        self._paths = [f.path for f in files]
        self._offsets = [f.header.offset for f in files]
        counts = np.array([1 if f.header.shape == shape else f.header.shape[0] for f in files], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._n = int(self._starts[-1])
        h = hashlib.sha256()
        for f in files:
            h.update(f"{os.path.basename(f.path)}\0{f.size}\0{f.mtime_ns}\n".encode())
        self._files_digest = h.hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "files": len(self._paths),
            "files_digest": self._files_digest,
            "shape": list(self.shape),
            "dtype": self.dtype.str,
        }

    def class_names(self) -> list[str] | None:
        return list(self._all_names)

    def locate(self, index: int) -> tuple[Path, int]:
        j = int(np.searchsorted(self._starts, index, side="right")) - 1
        return Path(self._paths[j]), index - int(self._starts[j])

    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        _check_range(batch, start, self._n)
        row = math.prod(self.shape) * self.dtype.itemsize
        starts = self._starts.tolist()
        j = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < self._n:
            k = min(batch, self._n - pos)
            x = np.empty((k, *self.shape), self.dtype)
            mv = x.reshape(-1).view(np.uint8).data
            filled = 0
            while filled < k:
                local = pos + filled - starts[j]
                take = min(starts[j + 1] - starts[j] - local, k - filled)
                _pread_into(
                    self._paths[j], self._offsets[j] + local * row, mv[filled * row : (filled + take) * row], local
                )
                filled += take
                if local + take == starts[j + 1] - starts[j]:
                    j += 1
            yield x, np.full(k, self.class_name)
            pos += k

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        _check_range(batch, start, self._n)
        for a in range(start, self._n, batch):
            yield np.full(min(batch, self._n - a), self.class_name)


# ---------------------------------------------------------------------------------------------- opening
def open_source(
    path: str | os.PathLike[str],
    *,
    label: Label | None = None,
    x_key: str = "x",
    y_key: str = "y",
    h5_x: str | None = None,
    h5_y: str | None = None,
    sample_shape: Sequence[int] | None = None,
) -> list[Source]:
    """Open ``path`` as ingest source(s); the path's kind decides how (see the module docstring).

    Args:
        path: an ``.npy``/``.npz``/``.h5``/``.hdf5`` file or a ``ROOT/<class>/*.npy`` directory.
        label: class name or id for every sample (required for ``.npy``; replaces ``y`` for npz/HDF5;
            refused for directories).
        x_key, y_key: array names inside an ``.npz``.
        h5_x, h5_y: dataset names inside an HDF5 file (default ``"x"``, ``"y"``).
        sample_shape: per-sample shape for a directory, settling whether equally shaped files are
            single samples or stacks (pass the store's shape when appending); ignored for files.

    Returns:
        One source for a file, one per non-empty class subdirectory for a directory.

    Raises:
        SourceError: missing, empty, truncated, corrupt or wrongly laid out input (one line, file named).
        ValueError: a bad argument (``label``, keys, ``sample_shape``).
    """
    p = Path(path)
    lab = _check_label(label)
    for opt, val in (("x_key", x_key), ("y_key", y_key), ("h5_x", h5_x), ("h5_y", h5_y)):
        if val is not None and (not isinstance(val, str) or not val):
            raise ValueError(f"{opt} must be a non-empty string, got {val!r}")
    shape = None
    if sample_shape is not None:
        shape = tuple(int(s) for s in sample_shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"sample_shape must be positive dimensions, got {tuple(sample_shape)}")
    if not p.exists():
        raise SourceError("no such file or directory", path=p)
    if p.is_dir() and (p / "data.mdb").is_file():  # a store is a source too (lmdbstore.store_source)
        from .store_source import open_store_source

        return open_store_source(p, label=lab)
    if p.is_dir():
        return _open_directory(p, lab, shape)
    suffix = p.suffix.lower()
    if suffix in NPY_SUFFIXES:
        return [NpySource(p, label=lab)]
    if suffix in NPZ_SUFFIXES:
        return [NpzSource(p, label=lab, x_key=x_key, y_key=y_key)]
    if suffix in H5_SUFFIXES:
        return [H5Source(p, label=lab, h5_x=h5_x or "x", h5_y=h5_y or "y")]
    raise SourceError(
        f"unsupported source type {suffix or '(no suffix)'!r}",
        path=p,
        hint="give an .npy, .npz, .h5/.hdf5 file or a directory ROOT/<class_name>/*.npy",
    )


def open_sources(paths: Iterable[str | os.PathLike[str]], **kwargs: Any) -> list[Source]:
    """Open every path with the same options (see :func:`open_source`); refuse a source given twice.

    Raises:
        ValueError: no paths.
        SourceError: as :func:`open_source`, or the same source twice (it would share a ledger entry).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Source] = []
    seen: dict[str, Source] = {}
    for p in paths:
        for src in open_source(p, **kwargs):
            fp = src.fingerprint()
            if fp in seen:
                raise SourceError(f"given more than once (also as {seen[fp].name})", path=src.path)
            seen[fp] = src
            out.append(src)
    if not out:
        raise ValueError("paths must name at least one source")
    return out


# ---------------------------------------------------------------------------------------------- validation
def _first_nonfinite(x: np.ndarray) -> int | None:
    if x.dtype.kind != "f" or not len(x):
        return None
    ok = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    return None if ok.all() else int(np.flatnonzero(~ok)[0])


def _first_bad_label(y: np.ndarray, classes: Sequence[str]) -> int | None:
    if y.dtype.kind in "US":
        bad = ~np.isin(y.astype(str), np.asarray(list(classes), dtype=str))
    elif y.dtype.kind in "iu":
        bad = (y < 0) | (y >= len(classes))
    else:
        return 0 if len(y) else None
    return int(np.flatnonzero(bad)[0]) if bad.any() else None


def scan_source(
    src: Source,
    *,
    shape: Sequence[int],
    dtype: Any,
    classes: Sequence[str],
    allow_nonfinite: bool = False,
    cast: bool = False,
    batch: int = 65536,
    progress: Callable[[int], None] | None = None,
    start: int = 0,
) -> None:
    """Validate every sample and label of ``src`` (from ``start``) against a store, writing nothing.

    Each batch goes through the writer's own :func:`~lmdbstore.writer.check_samples` and
    :func:`~lmdbstore.writer.label_ids`, so what passes here is what ``StoreWriter.append`` accepts.
    ``progress(n)`` is called with the number of samples checked after each batch (an increment,
    as ``tqdm.update`` takes).

    Raises:
        ValidationError: wrong shape or dtype, NaN/inf (unless ``allow_nonfinite``), an unknown class
            name or an id out of range; ``path`` is the file and ``key`` the first bad sample's index
            within that file (``None`` for shape/dtype, which concern the whole file).
        SourceError: the file cannot be read.
    """
    shape_t = tuple(int(s) for s in shape)
    want = np.dtype(dtype)
    pos = start
    for x, y in src.iter_batches(batch, start):
        try:
            check_samples(x, shape_t, want, allow_nonfinite=allow_nonfinite, cast=cast)
        except ValidationError as exc:
            bad = _first_nonfinite(x) if not allow_nonfinite and "non-finite" in exc.message else None
            if bad is None:
                raise ValidationError(exc.message, path=src.locate(pos)[0], hint=exc.hint) from exc
            file, idx = src.locate(pos + bad)
            raise ValidationError(
                "sample has a non-finite value (NaN or inf)", path=file, key=idx, hint=exc.hint
            ) from exc
        try:
            label_ids(y, len(x), classes)
        except ValidationError as exc:
            bad = _first_bad_label(np.asarray(y), classes)
            file, idx = src.locate(pos + (bad or 0))
            raise ValidationError(exc.message, path=file, key=idx if bad is not None else None, hint=exc.hint) from exc
        pos += len(x)
        if progress is not None:
            progress(len(x))


def infer_classes(sources: Sequence[Source], *, batch: int = 1 << 20) -> list[str]:
    """Class list for a new store when none is given.

    Rule: the sorted union of every class name the sources imply -- ``label=`` names, ``class_names``
    arrays, directory subdirectory names, and (with one pass over the labels only, for sources that
    have none of those) class-name labels found in the files.  If no source implies any name, the
    labels are integer ids and the classes are ``["0", ..., str(max id)]``.  Integer labels next to
    names index the sorted names, so their maximum must fit.

    Raises:
        ValueError: no sources.
        ValidationError: a negative integer label, or integer labels beyond the inferred names.
    """
    if not sources:
        raise ValueError("sources must not be empty")
    names: set[str] = set()
    max_id, max_src = -1, None
    for src in sources:
        implied = src.class_names()
        if implied is not None:
            names.update(implied)
            continue
        if isinstance(src.label, int):
            if src.label > max_id:
                max_id, max_src = src.label, src
            continue
        pos = 0
        for y in src.iter_labels(batch):
            if y.dtype.kind in "US":
                names.update(np.unique(y.astype(str)).tolist())
            elif len(y):
                lo = int(y.min())
                if lo < 0:
                    file, idx = src.locate(pos + int(np.argmin(y)))
                    raise ValidationError(f"label {lo} is negative", path=file, key=idx)
                if int(y.max()) > max_id:
                    max_id, max_src = int(y.max()), src
            pos += len(y)
    if not names:
        return [str(i) for i in range(max_id + 1)]
    result = sorted(names)
    if max_id >= len(result):
        assert max_src is not None
        raise ValidationError(
            f"integer label {max_id} is beyond the {len(result)} class names inferred ({', '.join(result[:10])})",
            path=max_src.path,
            hint="give the classes explicitly with --classes",
        )
    return result
