"""Opening paths as sources: the path's kind (store, directory, file suffix) picks the source class.

The suffix -> kind decision is the one table :data:`_FILE_OPENERS` (and TFRecord's names,
:func:`~lmdbstore.ingestion.sources.tfrecord.is_tfrecord_name`, whose shard names end in ``-00003-of-00016``); a
directory holding LMDB's data file is another store (:mod:`lmdbstore.ingestion.sources.store`), one holding
TFRecord files a set of shards (one source per file, in name order), any other directory a ``ROOT/<class>/*.npy``
tree.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmdbstore.config import DEFAULT_X_KEY, DEFAULT_Y_KEY
from lmdbstore.errors import SourceError
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.ingestion.sources.checks import Label, check_label, one_line
from lmdbstore.ingestion.sources.directory import open_directory
from lmdbstore.ingestion.sources.h5 import H5Source
from lmdbstore.ingestion.sources.npy import NpySource
from lmdbstore.ingestion.sources.npz import NpzSource
from lmdbstore.ingestion.sources.store import is_store_dir, open_store_source
from lmdbstore.ingestion.sources.tfrecord import TFRecordSource, is_tfrecord_name

__all__ = ["open_source", "open_sources"]


@dataclass(frozen=True)
class _Keys:
    """The member names :func:`open_source` was given for ``.npz`` arrays and HDF5 datasets."""

    x_key: str
    y_key: str
    h5_x: str | None
    h5_y: str | None
    dtype: Any = None
    sample_shape: tuple[int, ...] | None = None


#: File suffix (lower case) -> how a file with it is opened: the one place a suffix picks the kind.
_FILE_OPENERS: dict[str, Callable[[Path, Label | None, _Keys], Source]] = {
    ".npy": lambda p, lab, k: NpySource(p, label=lab),
    ".npz": lambda p, lab, k: NpzSource(p, label=lab, x_key=k.x_key, y_key=k.y_key),
    ".h5": lambda p, lab, k: H5Source(p, label=lab, h5_x=k.h5_x or "x", h5_y=k.h5_y or "y"),
    ".hdf5": lambda p, lab, k: H5Source(p, label=lab, h5_x=k.h5_x or "x", h5_y=k.h5_y or "y"),
}


def _tfrecord(p: Path, lab: Label | None, k: _Keys) -> Source:
    return TFRecordSource(p, label=lab, x_key=k.x_key, y_key=k.y_key, dtype=k.dtype, sample_shape=k.sample_shape)


def _tfrecord_shards(root: Path) -> list[Path]:
    """The TFRecord files directly in ``root``, in name order (none: it is not a directory of shards)."""
    try:
        return sorted(e for e in root.iterdir() if is_tfrecord_name(e.name) and e.is_file())
    except OSError as exc:
        raise SourceError(f"cannot list ({one_line(exc)})", path=root) from exc


def open_source(
    path: str | os.PathLike[str],
    *,
    label: Label | None = None,
    x_key: str = DEFAULT_X_KEY,
    y_key: str = DEFAULT_Y_KEY,
    h5_x: str | None = None,
    h5_y: str | None = None,
    sample_shape: Sequence[int] | None = None,
    dtype: Any = None,
) -> list[Source]:
    """Open ``path`` as ingest source(s); the path's kind decides how (see the :mod:`lmdbstore.ingestion.sources` docstring).

    Args:
        path: an ``.npy``/``.npz``/``.h5``/``.hdf5``/``.tfrecord`` file, a ``ROOT/<class>/*.npy`` directory or a
            directory of TFRecord shards.
        label: class name or id for every sample (required for ``.npy``; replaces ``y`` for npz/HDF5;
            refused for directories).
        x_key, y_key: array names inside an ``.npz``; feature names of a TFRecord's ``tf.train.Example``.
        h5_x, h5_y: dataset names inside an HDF5 file (default ``"x"``, ``"y"``).
        sample_shape: per-sample shape for a directory, settling whether its files are single samples
            or stacks (pass the store's shape when appending; default: the shape most files share,
            refusing directories where that is ambiguous); of a TFRecord's samples (default: 1-D); ignored
            for other files.
        dtype: the dtype of a TFRecord's samples stored as bytes (which do not record it); ignored for other
            sources.

    Returns:
        One source for a file, one per non-empty class subdirectory for a directory.

    Raises:
        SourceError: missing, empty, truncated, corrupt or wrongly laid out input (one line, file named).
        ValueError: a bad argument (``label``, keys, ``sample_shape``).
    """
    p = Path(path)
    lab = check_label(label)
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
    if is_store_dir(p):  # a store is a source too
        return open_store_source(p, label=lab)
    keys = _Keys(x_key, y_key, h5_x, h5_y, dtype, shape)
    if p.is_dir():
        shards = _tfrecord_shards(p)
        if shards:
            return [_tfrecord(f, lab, keys) for f in shards]
        return open_directory(p, lab, shape)
    if is_tfrecord_name(p.name):
        return [_tfrecord(p, lab, keys)]
    suffix = p.suffix.lower()
    opener = _FILE_OPENERS.get(suffix)
    if opener is not None:
        return [opener(p, lab, keys)]
    raise SourceError(
        f"unsupported source type {suffix or '(no suffix)'!r}",
        path=p,
        hint="give an .npy, .npz, .h5/.hdf5 or .tfrecord file, a directory ROOT/<class_name>/*.npy or a directory "
        "of TFRecord shards",
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
