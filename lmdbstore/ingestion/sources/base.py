"""The :class:`Source` interface, :class:`FileSource` (a source read from one file) and the conversions of a
file's own labels (ids through its ``class_names``, names, bounded ids), next to :class:`FileSource` which applies
them, so that every kind raises the same errors for the same labels.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from lmdbstore.errors import SourceError, ValidationError
from lmdbstore.format.ledger import source_key
from lmdbstore.format.limits import MAX_CLASS_NAME_CHARS, MAX_CLASSES
from lmdbstore.format.meta import controlled_name
from lmdbstore.ingestion.sources.checks import Label

__all__ = ["CLASS_NAMES_KEY", "FileSource", "Source", "const_labels"]

#: Name of the optional array/dataset listing the class names that integer labels index.
CLASS_NAMES_KEY = "class_names"


def const_labels(label: Label, n: int) -> np.ndarray:
    """``n`` copies of the ``label=`` option, as a ``str`` array (a name) or int64 ids."""
    if isinstance(label, str):
        return np.full(n, label)
    return np.full(n, label, np.int64)


# ---------------------------------------------------------------------------------------------- labels in files
def _labels_dtype_ok(dtype: np.dtype[Any]) -> bool:
    """Whether a label array's dtype holds class ids (ints) or class names (strings)."""
    return dtype.kind in "iuUS" and dtype.fields is None


def _check_names_layout(shape: tuple[int, ...], dtype: np.dtype[Any], chars: int | None, path: Path, what: str) -> None:
    """What a ``class_names`` member's header claims must be small before it is read whole.

    At most ``MAX_CLASSES`` names of at most ``MAX_CLASS_NAME_CHARS`` characters each (``chars``: the
    fixed string width the header declares, ``None`` for variable-length strings).
    """
    if len(shape) != 1 or shape[0] == 0:
        raise SourceError(f"{what} must be a non-empty 1-D array of strings, got {dtype} {shape}", path=path)
    if shape[0] > MAX_CLASSES:
        raise SourceError(f"{what} claims {shape[0]} class names; a store has at most {MAX_CLASSES} classes", path=path)
    if chars is not None and chars > MAX_CLASS_NAME_CHARS:
        raise SourceError(
            f"{what} claims names of {chars} characters; class names may have at most {MAX_CLASS_NAME_CHARS}",
            path=path,
        )


def _string_chars(dtype: np.dtype[Any]) -> int:
    """Characters per element of a fixed-width string dtype (``U``: 4 bytes each, ``S``: 1)."""
    return dtype.itemsize // 4 if dtype.kind == "U" else dtype.itemsize


def _names_to_list(arr: np.ndarray, path: Path, what: str) -> list[str]:
    """A file's ``class_names`` (strings, bytes or Python strings) as a list of distinct non-empty names of
    bounded length, none holding a control character (checked before numpy could drop a trailing NUL)."""
    if arr.ndim != 1 or arr.dtype.kind not in "USO" or len(arr) == 0:
        raise SourceError(f"{what} must be a non-empty 1-D array of strings, got {arr.dtype} {arr.shape}", path=path)
    raw = arr.tolist()
    if any(not isinstance(s, (str, bytes)) for s in raw):
        raise SourceError(f"{what} must hold strings", path=path)
    names = [s.decode("utf-8", "replace") if isinstance(s, bytes) else s for s in raw]
    _check_names_layout(arr.shape, arr.dtype, max(len(s) for s in names), path, what)
    if len(set(names)) != len(names) or any(not s.strip() for s in names):
        raise SourceError(f"{what} must hold distinct non-empty names", path=path)
    if controlled_name(raw) is not None:
        raise SourceError(f"{what} holds a name with a control character", path=path)
    return names


def _first_out_of_range(y: np.ndarray, n: int) -> int | None:
    """Index of the first integer label outside ``0..n-1`` (compared as stored: uint64 ids stay exact)."""
    bad = (y < 0) | (y >= n)
    return int(np.flatnonzero(bad)[0]) if bad.any() else None


def _ids_to_names(y: np.ndarray, names: list[str], path: Path, first: int) -> np.ndarray:
    """Map integer ids through the file's own ``class_names``; an id outside it is a ValidationError."""
    i = _first_out_of_range(y, len(names))
    if i is not None:
        raise ValidationError(
            f"label {int(y[i])} is outside the file's {CLASS_NAMES_KEY} (0..{len(names) - 1})",
            path=path,
            key=first + i,
        )
    return np.asarray(names)[y.astype(np.int64, copy=False)]


def _as_label_array(y: np.ndarray, path: Path, first: int) -> np.ndarray:
    """Labels as int64 ids or a str (``U``) array.

    Raises:
        ValidationError: a name holding a control character (:func:`~lmdbstore.format.meta.controlled_name`), or
            an unsigned id beyond the int64 range (named exactly, not wrapped negative): no store has that many.
    """
    if y.dtype.kind in "USO":  # names; Python strings (TFRecord, HDF5) keep a trailing NUL numpy would drop
        if controlled_name(np.unique(y).tolist()) is not None:
            at = next(k for k, name in enumerate(y.tolist()) if controlled_name((name,)) is not None)
            raise ValidationError(
                f"class label {str(y[at])[:60]!r} holds a control character", path=path, key=first + at
            )
        return y.astype(str)
    if y.dtype.kind == "u" and y.dtype.itemsize >= 8:
        i = _first_out_of_range(y, MAX_CLASSES)
        if i is not None and int(y[i]) > np.iinfo(np.int64).max:
            raise ValidationError(
                f"label {int(y[i])} is beyond the largest class id a store can have ({MAX_CLASSES - 1})",
                path=path,
                key=first + i,
            )
    return y.astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------------- the interface
class Source(ABC):
    """A readable sequence of samples with labels, streamed in batches: ``path`` (the file, or a directory
    source's class subdirectory), display ``name`` (``"data.npz[x]"``), per-sample ``shape``, ``dtype`` as found
    in the file (byte order included), and the ``label=`` option (``None``: labels from the file or directory)."""

    kind: ClassVar[str] = ""
    path: Path
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    label: Label | None = None
    _n: int = 0
    #: the file's own ``class_names`` (npz, HDF5), which its integer labels index
    _names: list[str] | None = None
    #: why the file's own class names cannot be read, raised where they are needed (``classes=`` settles them)
    _names_error: SourceError | None = None

    def __len__(self) -> int:
        """Number of samples."""
        return self._n

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} n={self._n} shape={self.shape} dtype={self.dtype}>"

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What identifies this source's content: kind, resolved path, size, mtime_ns, keys, label option."""

    def fingerprint(self) -> str:
        """Stable id for the resume ledger, ``kind:<sha256 prefix of describe()>:<file name>`` (bounded: an LMDB
        key); changes whenever :meth:`describe` does (e.g. the file changes)."""
        blob = json.dumps(self.describe(), sort_keys=True, default=str).encode()
        digest = hashlib.sha256(blob).hexdigest()[:32]
        return source_key(self.kind, digest, self.path.name)

    def class_names(self) -> list[str] | None:
        """Class names the source implies (a ``label=`` name, the file's ``class_names``, subdirectories) or None.

        Raises:
            SourceError: the file has class names that cannot be read (give the classes instead).
        """
        if self.label is None and self._names_error is not None:
            raise self._names_error
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


class FileSource(Source):
    """A source read from one file (``.npy``, ``.npz``, HDF5), identified by the file's stat at opening.

    :meth:`describe` lists the kind, resolved path, size, mtime, the member-name options named in
    ``_key_options`` and the ``label=`` option.  The kinds whose file holds its own label array (npz,
    HDF5) share its checks and the mapping of its ids through the file's ``class_names`` here.
    """

    #: attributes naming the sample/label members, recorded by :meth:`describe` (e.g. ``x_key``, ``y_key``)
    _key_options: ClassVar[tuple[str, ...]] = ()
    #: what the format calls a named member in messages: ``"array"`` (npz) or ``"dataset"`` (HDF5)
    _member_word: ClassVar[str] = "array"
    _stat: os.stat_result

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path.resolve()),
            "size": self._stat.st_size,
            "mtime_ns": self._stat.st_mtime_ns,
            **{key: getattr(self, key) for key in self._key_options},
            "label": self.label,
        }

    def _check_label_array(
        self, shape: tuple[int, ...], dtype: Any, x_key: str, y_key: str, *, is_str: bool = False
    ) -> None:
        """The file's label array must be 1-D class ids or names (a string dtype, or ``is_str``), one per sample."""
        word = self._member_word
        if len(shape) != 1 or not (is_str or _labels_dtype_ok(np.dtype(dtype))):
            raise SourceError(
                f"label {word} {y_key!r} must be 1-D class ids or class names, got dtype {dtype} shape {shape}",
                path=self.path,
            )
        if shape[0] != self._n:
            raise SourceError(
                f"{word} {x_key!r} has {self._n} samples but label {word} {y_key!r} has {shape[0]}", path=self.path
            )

    def _check_names_header(
        self, shape: tuple[int, ...], dtype: Any, *, is_str: bool = False, what: str | None = None
    ) -> None:
        """Before the file's ``class_names`` member (``what``, default the ``class_names`` member) is read whole:
        from its header alone, it must be 1-D strings (a string dtype, or ``is_str`` for variable-length ones) of
        bounded count and width."""
        what = what or f"{self._member_word} {CLASS_NAMES_KEY!r}"
        dt = np.dtype(dtype)
        if dt.kind not in "US" and not is_str:
            raise SourceError(f"{what} must be a 1-D array of strings, got {dt} {shape}", path=self.path)
        _check_names_layout(shape, dt, _string_chars(dt) if dt.kind in "US" else None, self.path, what)

    def _set_names(self, arr: np.ndarray, what: str | None = None) -> None:
        """Keep the file's ``class_names`` member ``arr`` (``what``), checked to be distinct non-empty strings."""
        self._names = _names_to_list(arr, self.path, what or f"{self._member_word} {CLASS_NAMES_KEY!r}")

    def iter_batches(self, batch: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for x, y in self._read(batch, start, with_x=True):
            assert x is not None
            yield x, y

    def iter_labels(self, batch: int, start: int = 0) -> Iterator[np.ndarray]:
        for _, y in self._read(batch, start, with_x=False):
            yield y

    @abstractmethod
    def _read(self, batch: int, start: int, with_x: bool) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        """The ``(x, y)`` batches :meth:`iter_batches` yields, ``x`` only ``with_x`` (else ``None`` where the kind
        reads the labels alone)."""

    def _labels(self, y: np.ndarray, first: int) -> np.ndarray:
        """Labels read from the file starting at sample ``first``, as :meth:`Source.iter_batches` yields them.

        Integer ids index the file's own ``class_names`` when it has them; otherwise ids stay ids and names names.
        """
        if self._names is not None and y.dtype.kind in "iu":
            return _ids_to_names(y, self._names, self.path, first)
        return _as_label_array(y, self.path, first)
