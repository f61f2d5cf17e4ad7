"""``.npz`` sources: sample and label arrays streamed straight out of the zip archive.

``np.load`` would decompress a whole member into memory; :class:`_ZipMember` instead parses the
member's ``.npy`` header and reads rows from the (stored or deflated) zip stream batch by batch
(:func:`~lmdbstore.ingestion.sources.npyio.read_rows`, as ``.npy`` files are read).
"""

from __future__ import annotations

import itertools
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from numpy.lib import format as npformat

from lmdbstore.errors import SourceError, one_line, preview
from lmdbstore.ingestion.sources.base import CLASS_NAMES_KEY, FileSource, const_labels
from lmdbstore.ingestion.sources.checks import READ_ERRORS, Label, check_range, stat_file
from lmdbstore.ingestion.sources.npyio import check_size, check_stack, read_header, read_rows


class _ZipMember:
    """One ``.npy`` member of an ``.npz``: its header and a way to stream rows from it."""

    def __init__(self, zf: zipfile.ZipFile, member: str, path: Path, what: str) -> None:
        self.member, self.what = member, what
        try:
            info = zf.getinfo(member)
            with zf.open(info) as fp:
                self.header = read_header(fp, path, what)
        except (*READ_ERRORS, RuntimeError, NotImplementedError) as exc:
            raise SourceError(f"cannot read {what} ({one_line(exc)})", path=path) from exc
        if self.header.dtype.hasobject:
            raise SourceError(f"{what} holds pickled Python objects; save a numeric or string array", path=path)
        check_size(self.header, info.file_size, path, what)

    def read_all(self, zf: zipfile.ZipFile, path: Path) -> np.ndarray:
        """Load the whole member (only for small arrays such as ``class_names``)."""
        try:
            with zf.open(self.member) as fp:
                return npformat.read_array(fp, allow_pickle=False)
        except (*READ_ERRORS, RuntimeError) as exc:
            raise SourceError(f"cannot read {self.what} ({one_line(exc)})", path=path) from exc

    def rows(self, zf: zipfile.ZipFile, path: Path, batch: int, start: int) -> Iterator[np.ndarray]:
        """Stream rows ``start..`` of the member in arrays of ``batch`` rows (:func:`read_rows`)."""
        try:
            fp = zf.open(self.member)
        except (*READ_ERRORS, RuntimeError) as exc:
            raise SourceError(f"cannot open {self.what} ({one_line(exc)})", path=path) from exc
        with fp:
            yield from read_rows(fp, self.header, path, self.what, batch, start)


class NpzSource(FileSource):
    """An ``.npz`` archive: samples ``x_key``, labels ``y_key`` (or ``label``), optional ``class_names``."""

    kind = "npz"
    _key_options = ("x_key", "y_key")

    def __init__(self, path: Path, *, label: Label | None, x_key: str, y_key: str) -> None:
        self._stat = stat_file(path)
        self.path, self.label, self.x_key, self.y_key = path, label, x_key, y_key
        self.name = f"{path}[{x_key}]"
        with self._open_zip() as zf:
            members = {n[:-4]: n for n in zf.namelist() if n.endswith(".npy")}
            present = preview(sorted(members)) or "none"
            if x_key not in members:
                raise SourceError(
                    f"no array {x_key!r} in the archive; it holds: {present}", path=path, hint="choose one with x_key="
                )
            self._x = _ZipMember(zf, members[x_key], path, f"array {x_key!r}")
            check_stack(self._x.header, path, f"array {x_key!r}")
            self.shape, self.dtype, self._n = self._x.header.shape[1:], self._x.header.dtype, self._x.header.shape[0]
            self._y: _ZipMember | None = None
            if label is None:
                if y_key not in members:
                    raise SourceError(
                        f"no label array {y_key!r} in the archive; it holds: {present}",
                        path=path,
                        hint="choose one with y_key= or label all samples with label=CLASS",
                    )
                self._y = _ZipMember(zf, members[y_key], path, f"array {y_key!r}")
                yh = self._y.header
                self._check_label_array(yh.shape, yh.dtype, x_key, y_key)
            self._names: list[str] | None = None
            if CLASS_NAMES_KEY in members and CLASS_NAMES_KEY not in (x_key, y_key):
                m = _ZipMember(zf, members[CLASS_NAMES_KEY], path, f"array {CLASS_NAMES_KEY!r}")
                self._check_names_header(m.header.shape, m.header.dtype)  # before reading it whole
                self._set_names(m.read_all(zf, path))

    def _open_zip(self) -> zipfile.ZipFile:
        try:
            return zipfile.ZipFile(self.path)
        except (*READ_ERRORS, RuntimeError) as exc:
            raise SourceError(f"not a readable .npz (zip) archive ({one_line(exc)})", path=self.path) from exc

    def _read(self, batch: int, start: int, with_x: bool) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        check_range(batch, start, self._n)
        with self._open_zip() as zf:
            xs = self._x.rows(zf, self.path, batch, start) if with_x else itertools.repeat(None)
            ys = self._y.rows(zf, self.path, batch, start) if self._y is not None else itertools.repeat(None)
            for a, x, y in zip(range(start, self._n, batch), xs, ys, strict=False):  # rows end with the range
                if y is not None:
                    yield x, self._labels(y, a)
                else:
                    assert self.label is not None
                    yield x, const_labels(self.label, min(batch, self._n - a))
