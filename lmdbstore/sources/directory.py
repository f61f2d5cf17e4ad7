"""Directory sources ``ROOT/<class>/*.npy``: one :class:`DirectoryClassSource` per class subdirectory.

Each file is one sample or a stack of samples, labelled by its subdirectory; files are read in name
order, and tiny single-sample files are gathered into full batches with ``preadv``.  One source per
class (not per file) keeps the resume ledger to one entry per class even for millions of files.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SourceError
from .base import Label, Source, _check_range, _one_line
from .npyio import _check_sample_dtype, _check_size, _Header, _pread_into, _read_header

#: Bytes read to peek at a directory file's header (covers every header numpy writes for ndim <= 4).
_PEEK_BYTES = 4096
_NPY_MAGIC = b"\x93NUMPY"


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
    """One ``.npy`` file of a class subdirectory, as found when the directory was opened."""

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
    """Check every file of ``ROOT/<class>/*.npy`` (headers, sizes, one shape and dtype) and return a source per class."""
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
