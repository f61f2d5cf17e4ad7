"""Directory sources ``ROOT/<class>/*.npy``: one :class:`DirectoryClassSource` per class subdirectory (one ledger
entry per class, even for millions of files); files in name order, tiny ones gathered into batches with ``preadv``.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import SourceError, one_line
from lmdbstore.format.meta import controlled_name
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.ingestion.sources.checks import Label, check_range
from lmdbstore.ingestion.sources.npyio import NpyHeader, check_sample_dtype, check_size, pread_into, read_header

#: Bytes read to peek at a directory file's header (covers every header numpy writes for ndim <= 4).
_PEEK_BYTES = 4096
_NPY_MAGIC = b"\x93NUMPY"


class _HeaderCache:
    """Parses directory-file headers, reusing the parse for byte-identical headers (tiny files share one)."""

    def __init__(self) -> None:
        self._parsed: dict[bytes, NpyHeader] = {}

    def read(self, path: str) -> NpyHeader:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                head = os.read(fd, _PEEK_BYTES)
            finally:
                os.close(fd)
        except OSError as exc:
            raise SourceError(f"cannot read ({one_line(exc)})", path=path) from exc
        key = self._header_bytes(head)
        if key is not None and key in self._parsed:
            return self._parsed[key]
        if key is None and len(head) == _PEEK_BYTES:  # huge header: parse from the file itself
            with open(path, "rb") as f:
                return read_header(f, path)
        h = read_header(io.BytesIO(head), path)
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
    header: NpyHeader
    size: int
    mtime_ns: int


def _scan_class_dir(d: Path, is_source: Callable[[str], bool]) -> list[tuple[str, str, int, int]]:
    """(name, path, size, mtime_ns) of the ``*.npy`` files directly in ``d``, sorted by name; a subdirectory or
    a file of another source kind (``is_source``) beside them is refused (it would be dropped in silence).

    Plain strings, not ``Path`` objects: a class may hold millions of tiny files.
    """
    out = []
    try:
        with os.scandir(d) as it:
            for e in it:
                if e.name.startswith("."):
                    continue
                if e.name.endswith(".npy") and e.is_file():
                    st = e.stat()
                    out.append((e.name, e.path, st.st_size, st.st_mtime_ns))
                elif e.is_dir() or is_source(e.name):
                    raise SourceError(
                        f"the class directory holds {e.name!r} beside its .npy files; it reads only those",
                        path=d,
                        hint="move it elsewhere, or give it as a source of its own",
                    )
    except OSError as exc:
        raise SourceError(f"cannot list ({one_line(exc)})", path=d) from exc
    out.sort()
    return out


def _rel(path: str) -> str:
    """``class/file.npy``: how a directory file is named next to another one in a message."""
    return "/".join(path.split(os.sep)[-2:])


#: Odd files named in one error message before the rest are only counted.
_NAMED_FILES = 3
_SHAPE_HINT = "pass the sample shape explicitly with sample_shape=H,W"


def _fits(s: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a file of shape ``s`` is one sample of ``shape`` or a stack ``(N, *shape)``."""
    return s == shape or (len(s) == len(shape) + 1 and s[1:] == shape)


def _refuse_odd_files(root: Path, files: list[_DirFile], shape: tuple[int, ...], why: str, remedy: str) -> None:
    """Raise naming the files that do not fit ``shape`` (at most a few, then a count); return if none.

    ``why`` says where ``shape`` comes from, ``remedy`` what to do besides removing the files.
    """
    odd = [f for f in files if not _fits(f.header.shape, shape)]
    if not odd:
        return
    expected = f"expected one sample {shape} or a stack (N, *{shape})"
    hint = f"remove the file{'s' if len(odd) > 1 else ''}, or {remedy}"
    if len(odd) == 1:
        raise SourceError(f"file has shape {odd[0].header.shape}, but {why}; {expected}", path=odd[0].path, hint=hint)
    named = ", ".join(f"{_rel(f.path)} {f.header.shape}" for f in odd[:_NAMED_FILES])
    more = f" ... ({len(odd) - _NAMED_FILES:,} more)" if len(odd) > _NAMED_FILES else ""
    raise SourceError(
        f"{len(odd):,} of {len(files):,} files do not fit: {named}{more}; {why}; {expected}", path=root, hint=hint
    )


def _decide_sample_shape(root: Path, files: list[_DirFile], sample_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """Per-sample shape of a directory (given, or inferred from the majority of files); refuse odd files.

    Each file is one sample of shape ``S`` or a stack ``(N, *S)``.  Without ``sample_shape``:

    * all files of one shape are single samples of it;
    * a shape held by more than half of the files is the sample shape (stacks of it fit too), so one
      malformed file cannot turn a directory of samples into stacks of their rows;
    * two shapes held by half of the files each: the one the other half are stacks of;
    * otherwise the one shape that more than half of the files fit, as samples or stacks (e.g. stacks
      of varying lengths).

    Anything else is ambiguous and refused: pass ``sample_shape``.  Files that do not fit the
    decided shape are refused, the first few named.
    """
    if sample_shape is not None:
        remedy = "pass a sample shape that they all fit"
        _refuse_odd_files(root, files, sample_shape, f"the given sample shape is {sample_shape}", remedy)
        return sample_shape
    counts = Counter(f.header.shape for f in files)
    if len(counts) == 1:
        return files[0].header.shape
    n = len(files)
    (top, c), *_ = ranked = counts.most_common()
    if 2 * c > n:
        # reading every file as a stack of rows, when that fits them all, is offered in the hint
        remedy = _SHAPE_HINT
        if len(top) > 1 and all(_fits(s, top[1:]) for s in counts):
            remedy += f"; sample_shape={','.join(map(str, top[1:]))} reads every file as a stack of {top[1:]} samples"
        _refuse_odd_files(root, files, top, f"{c:,} of {n:,} files have {top}", remedy)
        return top
    if 2 * c == n and c > 1:  # two equal halves: settled only when one half are samples the others stack
        whole = [s for s, k in ranked if k == c and all(_fits(t, s) for t in counts)]
        if whole:
            return whole[0]
    else:  # no shape shared by half of the files: the one shape that fits most of them (e.g. stacks)
        candidates = set(counts) | {s[1:] for s in counts if len(s) > 1}
        explained = sorted(((sum(k for t, k in counts.items() if _fits(t, s)), s) for s in candidates), reverse=True)
        (best, shape), (second, _) = explained[:2]
        if 2 * best > n and best > second:
            _refuse_odd_files(root, files, shape, f"{best:,} of {n:,} files fit {shape}", _SHAPE_HINT)
            return shape
    listed = ", ".join(f"{s} in {k:,}" for s, k in ranked[:_NAMED_FILES])
    more = f" ... ({len(ranked) - _NAMED_FILES:,} more shapes)" if len(ranked) > _NAMED_FILES else ""
    raise SourceError(f"cannot tell the sample shape: the files disagree ({listed}{more})", path=root, hint=_SHAPE_HINT)


def open_directory(
    root: Path, label: Label | None, sample_shape: tuple[int, ...] | None, is_source: Callable[[str], bool]
) -> list[Source]:
    """Check every file of ``ROOT/<class>/*.npy`` (headers, sizes, one shape and dtype) and return a source per
    class; ``is_source`` tells the names of files of other source kinds, refused in a class directory."""
    if label is not None:
        raise SourceError(
            "label= does not apply to a directory; its labels are the class subdirectory names", path=root
        )
    try:
        class_dirs = sorted(
            (e for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")), key=lambda e: e.name
        )
    except OSError as exc:
        raise SourceError(f"cannot list ({one_line(exc)})", path=root) from exc
    if not class_dirs:
        raise SourceError(
            "directory has no class subdirectories", path=root, hint="lay it out as ROOT/<class_name>/*.npy"
        )
    names = [e.name for e in class_dirs]
    bad = controlled_name(names)
    if bad is not None:
        raise SourceError(f"class subdirectory {bad[:60]!r} holds a control character", path=root)
    cache = _HeaderCache()
    per_class: list[tuple[str, list[_DirFile]]] = []
    for name in names:
        files = []
        for _, p, size, mtime in _scan_class_dir(root / name, is_source):
            if size == 0:
                raise SourceError("file is empty (0 bytes)", path=p)
            h = cache.read(p)
            check_sample_dtype(h.dtype, p, "the array")
            if len(h.shape) == 0 or math.prod(h.shape) == 0:
                raise SourceError(f"the array has shape {h.shape}; expected a sample or a stack of samples", path=p)
            if h.fortran and len(h.shape) > 1:
                raise SourceError("the array is stored in Fortran order; save it C-ordered", path=p)
            check_size(h, size, p, "the array")
            files.append(_DirFile(p, h, size, mtime))
        if files:
            per_class.append((name, files))
    if not per_class:
        raise SourceError(
            "no .npy files in the class subdirectories", path=root, hint="expected ROOT/<class_name>/*.npy"
        )
    all_files = [f for _, fs in per_class for f in fs]
    shape = _decide_sample_shape(root, all_files, sample_shape)
    dtype = all_files[0].header.dtype
    for f in all_files:
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
        check_range(batch, start, self._n)
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
                pread_into(
                    self._paths[j], self._offsets[j] + local * row, mv[filled * row : (filled + take) * row], local
                )
                filled += take
                if local + take == starts[j + 1] - starts[j]:
                    j += 1
            yield x, np.full(k, self.class_name)
            pos += k

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        check_range(batch, start, self._n)
        for a in range(start, self._n, batch):
            yield np.full(min(batch, self._n - a), self.class_name)
