"""HDF5 sources (``.h5``/``.hdf5``): sample and label datasets read in slices through ``h5py``.

``h5py`` is an optional dependency (the ``hdf5`` extra); it is imported only when an HDF5 file is
opened, so ``import lmdbstore`` works without it and a missing package is a one-line SourceError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import PREVIEW_ITEMS, SourceError, clip, one_line, preview
from lmdbstore.ingestion.sources.base import CLASS_NAMES_KEY, FileSource, const_labels
from lmdbstore.ingestion.sources.checks import READ_ERRORS, Label, check_range, stat_file
from lmdbstore.ingestion.sources.npyio import NpyHeader, check_stack

#: A dataset of an HDF5 file naming its classes when it has no ``class_names`` (the other common name).
CLASSES_KEY = "classes"


def _import_h5py(path: Path) -> Any:
    """The ``h5py`` module, or a SourceError naming the extra that installs it."""
    try:
        import h5py
    except ImportError as exc:
        raise SourceError(
            "reading HDF5 needs the h5py package", path=path, hint="pip install 'lmdbstore[hdf5]'"
        ) from exc
    return h5py


def _attribute_names(value: Any, what: str, path: Path) -> np.ndarray:
    """The class names of a ``class_names`` attribute as h5py reads it: an array (checked by the caller), or one
    string: a JSON list, names separated by commas or by newlines, or a single name (``SourceError`` naming the
    attribute ``what``: none of these, or a list several ways, as a space without a separator)."""
    arr = np.asarray(value)
    text = arr.item() if arr.ndim == 0 else None
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if not isinstance(text, str):
        return arr  # an array, or a scalar that is no string: checked by the caller
    text = text.strip()
    seps = [sep for sep in (",", "\n") if sep in text]
    try:
        names = json.loads(text) if text.startswith("[") else None
    except ValueError:
        names = None
    if not text.startswith("["):
        names = [n.strip() for n in text.split(seps[0])] if len(seps) == 1 else None if seps else text.split()
    if not isinstance(names, list) or (not seps and len(names) > 1):  # "cat dog": a name with a space, or two?
        raise SourceError(
            f"{what} does not list class names unambiguously: {clip(text)!r} (a JSON list, or names separated "
            "by commas or newlines)",
            path=path,
        )
    return np.array(names, dtype=object)


def _h5_dataset_names(f: Any) -> str:
    """A few of the file's dataset names (and how many more there are), for a "no such dataset" message."""
    names: list[str] = []
    total = 0

    def visit(name: str, obj: Any) -> None:
        nonlocal total
        if hasattr(obj, "shape"):
            total += 1
            if len(names) < PREVIEW_ITEMS:
                names.append(name)

    f.visititems(visit)
    return preview(names, total=total) or "none"


class H5Source(FileSource):
    """An HDF5 file: samples in dataset ``h5_x``, labels in ``h5_y`` (or ``label``), class names (optional) as
    :meth:`_read_names` finds them.  Picklable (``workers=`` sends sources to other processes): it keeps no open
    file and no module."""

    kind = "h5"
    _key_options = ("h5_x", "h5_y")
    _member_word = "dataset"

    def __init__(self, path: Path, *, label: Label | None, h5_x: str, h5_y: str) -> None:
        self._stat = stat_file(path)
        self.path, self.label, self.h5_x, self.h5_y = path, label, h5_x, h5_y
        self.name = f"{path}[{h5_x}]"
        self._names: list[str] | None = None
        self._y_is_str = False
        h5py = _import_h5py(path)
        with self._open() as f:
            x = self._dataset(f, h5_x, "samples", "x_key=")
            check_stack(NpyHeader(tuple(x.shape), np.dtype(x.dtype), False, 0), path, f"dataset {h5_x!r}")
            self.shape, self.dtype, self._n = tuple(int(s) for s in x.shape[1:]), np.dtype(x.dtype), int(x.shape[0])
            if label is None:
                y = self._dataset(f, h5_y, "labels", "y_key= or label all samples with label=CLASS")
                self._y_is_str = h5py.check_string_dtype(y.dtype) is not None
                self._check_label_array(y.shape, y.dtype, h5_x, h5_y, is_str=self._y_is_str)
            self._read_names(f, h5py)

    def _read_names(self, f: Any, h5py: Any) -> None:
        """The file's class names: a ``class_names`` attribute of the label dataset or of the file (see
        :func:`_attribute_names`), or a ``class_names`` or ``classes`` dataset (not one of the sample or label
        datasets; checked from its header before it is read whole).  Names that cannot be read are an error only
        where they are needed (:meth:`class_names`): ``classes=`` settles what the file's ids mean."""
        y = f.get(self.h5_y) if self.label is None else None
        try:
            for holder, where in ((y, f"of dataset {self.h5_y!r}"), (f, "of the file")):
                attr = None if holder is None else holder.attrs.get(CLASS_NAMES_KEY)
                if attr is not None:
                    what = f"attribute {CLASS_NAMES_KEY!r} {where}"
                    self._set_names(_attribute_names(attr, what, self.path), what)
                    return
            for key in (CLASS_NAMES_KEY, CLASSES_KEY):
                names = f.get(key)
                if names is None or not hasattr(names, "shape") or key in (self.h5_x, self.h5_y):
                    continue
                what = f"dataset {key!r}"
                is_str = h5py.check_string_dtype(names.dtype) is not None  # variable-length: checked once read
                self._check_names_header(tuple(names.shape), names.dtype, is_str=is_str, what=what)
                try:
                    arr = np.asarray(names.asstr()[()] if names.dtype.kind in "OS" else names[()])
                except (*READ_ERRORS, TypeError) as exc:
                    raise SourceError(f"cannot read {what} ({one_line(exc)})", path=self.path) from exc
                self._set_names(arr, what=what)
                return
        except SourceError as exc:
            self._names_error = SourceError(exc.message, path=self.path, hint="give the classes with classes=")

    def _open(self) -> Any:
        h5py = _import_h5py(self.path)
        try:
            return h5py.File(self.path, "r")
        except (OSError, ValueError) as exc:
            raise SourceError(f"not a readable HDF5 file ({one_line(exc)})", path=self.path) from exc

    def _dataset(self, f: Any, key: str, what: str, option: str) -> Any:
        ds = f.get(key)
        if ds is None or not hasattr(ds, "shape"):
            raise SourceError(
                f"no {what} dataset {key!r} in the file; it holds: {_h5_dataset_names(f)}",
                path=self.path,
                hint=f"choose one with {option}",
            )
        return ds

    def _read_labels(self, y: Any, a: int, b: int) -> np.ndarray:
        arr = np.asarray(y.asstr()[a:b], dtype=object) if self._y_is_str else np.asarray(y[a:b])  # NULs kept
        return self._labels(arr, a)

    def _read(self, batch: int, start: int, with_x: bool) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        check_range(batch, start, self._n)
        with self._open() as f:
            x, y = f[self.h5_x], (f[self.h5_y] if self.label is None else None)
            for a in range(start, self._n, batch):
                b = min(a + batch, self._n)
                try:
                    xb = np.ascontiguousarray(x[a:b]) if with_x else None
                    yb = const_labels(self.label, b - a) if y is None else self._read_labels(y, a, b)  # type: ignore[arg-type]
                except (*READ_ERRORS, RuntimeError, KeyError) as exc:
                    raise SourceError(f"read failed ({one_line(exc)})", path=self.path, key=a) from exc
                yield xb, yb
