"""Opening paths as sources: the path's kind picks the source class.  A file's suffix through the one table
:data:`_FILE_OPENERS` (and TFRecord's shard names); a directory holding LMDB's data file is another store, one
holding TFRecord files a set of shards, any other a ``ROOT/<class>/*.npy`` tree; one mixing kinds is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lmdbstore.config import DEFAULT_X_KEY, DEFAULT_Y_KEY
from lmdbstore.errors import SourceError, one_line, preview
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.ingestion.sources.checks import Label, check_label
from lmdbstore.ingestion.sources.directory import open_directory
from lmdbstore.ingestion.sources.h5 import H5Source
from lmdbstore.ingestion.sources.npy import NpySource
from lmdbstore.ingestion.sources.npz import NpzSource
from lmdbstore.ingestion.sources.store import StoreSource
from lmdbstore.ingestion.sources.tfrecord import TFRecordSource, is_tfrecord_name
from lmdbstore.ingestion.sources.tfrecord_io import COMPRESSIONS
from lmdbstore.store.env import DATA_FILE

__all__ = ["open_source", "open_sources"]


#: File suffix (lower case) -> how a file with it is opened (label, x_key, y_key): the one place a suffix picks it.
_FILE_OPENERS: dict[str, Callable[[Path, Label | None, str, str], Source]] = {
    ".npy": lambda p, lab, x, y: NpySource(p, label=lab),
    ".npz": lambda p, lab, x, y: NpzSource(p, label=lab, x_key=x, y_key=y),
    ".h5": lambda p, lab, x, y: H5Source(p, label=lab, h5_x=x, h5_y=y),
    ".hdf5": lambda p, lab, x, y: H5Source(p, label=lab, h5_x=x, h5_y=y),
}


def _is_source_name(name: str) -> bool:
    """Whether a file of this name would be read as a source (see :data:`_FILE_OPENERS`)."""
    return is_tfrecord_name(name) or Path(name).suffix.lower() in _FILE_OPENERS


def _directory_kinds(root: Path) -> dict[str, list[str]]:
    """What the directory ``root`` holds, by the kind it would be read as (hidden entries aside): a store (LMDB's
    data file), TFRecord shards, class subdirectories, other source files; refused when it holds several of them.

    Raises:
        SourceError: the directory mixes kinds (reading one would drop the others in silence).
    """
    found: dict[str, list[str]] = {"a store": [], "TFRecord files": [], "class subdirectories": [], "files": []}
    try:
        for e in os.scandir(root):
            if e.name.startswith("."):
                continue
            kind = (
                "a store" if e.name == DATA_FILE
                else "class subdirectories" if e.is_dir()
                else "TFRecord files" if is_tfrecord_name(e.name)
                else "files" if _is_source_name(e.name)
                else None
            )  # fmt: skip
            if kind is not None:
                found[kind].append(e.name)
    except OSError as exc:
        raise SourceError(f"cannot list ({one_line(exc)})", path=root) from exc
    kinds = {kind: sorted(names) for kind, names in found.items() if names}
    if len(kinds) > 1 and set(kinds) != {"files"}:
        raise SourceError(
            f"the directory mixes {' and '.join(f'{k} ({preview(v)})' for k, v in kinds.items())}; it is read as "
            "one kind",
            path=root,
            hint="move one kind elsewhere, or give its files as sources of their own",
        )
    return kinds


def open_source(
    path: str | os.PathLike[str],
    *,
    label: Label | None = None,
    x_key: str = DEFAULT_X_KEY,
    y_key: str = DEFAULT_Y_KEY,
    sample_shape: Sequence[int] | None = None,
    dtype: Any = None,
    compression: str | None = None,
) -> list[Source]:
    """Open ``path`` as ingest source(s); the path's kind decides how (see the :mod:`lmdbstore.ingestion.sources` docstring).

    Args:
        path: a file, a ``ROOT/<class>/*.npy`` directory, a directory of TFRecord shards or another store.
        label: class name or id for every sample (required for ``.npy``; replaces ``y`` for npz/HDF5;
            refused for directories).
        x_key, y_key: array names inside an ``.npz``, dataset names inside an HDF5 file, feature names of a
            TFRecord's ``tf.train.Example``.
        sample_shape: per-sample shape for a directory, settling whether its files are single samples or
            stacks (default: the shape most files share, refusing directories where that is ambiguous); of a
            TFRecord's samples (default: 1-D).
        dtype: the dtype of a TFRecord's samples stored as bytes, byte order included (``">f4"``: big-endian).
        compression: how TFRecord files are stored: ``"none"``, ``"gzip"`` or ``"zlib"`` (default: told by each
            file's first bytes).  Each of the last three is ignored by the other sources.

    Returns:
        One source for a file, one per non-empty class subdirectory for a directory.

    Raises:
        SourceError: missing, empty, truncated, corrupt or wrongly laid out input (one line, file named), a
            directory mixing kinds (a stray ``.tfrecord`` beside class subdirectories...).
        ValueError: a bad argument (``label``, keys, ``sample_shape``, ``compression``).
    """
    p = Path(path)
    lab = check_label(label)
    for opt, val in (("x_key", x_key), ("y_key", y_key)):
        if not isinstance(val, str) or not val:
            raise ValueError(f"{opt} must be a non-empty string, got {val!r}")
    shape = None
    if sample_shape is not None:
        shape = tuple(int(s) for s in sample_shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"sample_shape must be positive dimensions, got {tuple(sample_shape)}")
    if compression is not None and compression.lower() not in COMPRESSIONS:
        raise ValueError(
            f"compression must be one of {', '.join(COMPRESSIONS)} (or None: told by the file), got {compression!r}"
        )
    if not p.exists():
        raise SourceError("no such file or directory", path=p)
    kinds = _directory_kinds(p) if p.is_dir() else {}
    if "a store" in kinds:  # a store is a source too
        return [StoreSource(p, label=lab)]
    shards = [p / f for f in kinds.get("TFRecord files", [])] if p.is_dir() else [p] if is_tfrecord_name(p.name) else []
    if shards:
        how = compression and compression.lower()
        kw = {"x_key": x_key, "y_key": y_key, "dtype": dtype, "sample_shape": shape, "compression": how}
        return [TFRecordSource(f, label=lab, **kw) for f in shards]
    if p.is_dir():
        return open_directory(p, lab, shape, _is_source_name)
    suffix = p.suffix.lower()
    opener = _FILE_OPENERS.get(suffix)
    if opener is not None:
        return [opener(p, lab, x_key, y_key)]
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
