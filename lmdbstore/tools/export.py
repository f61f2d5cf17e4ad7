"""Getting data back out of a store: :func:`export_store` writes a selection to ``.npy``/``.npz``/HDF5.

Exports stream (memory: one chunk plus the index and label tables) and are renamed into place at the end, so a
failed export leaves no partial file.  What is exported is a :func:`select_indices` selection; with a class
selection the output's ``class_names`` are the selected classes (in store order) and the ids are renumbered to
index them, so ingesting the export gives a store of just those classes.  The layouts are
:mod:`lmdbstore.tools.export_formats`'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.config import DEFAULT_COMPRESS, DEFAULT_EXPORT_CHUNK, DEFAULT_VAL_FRACTION, LoaderConfig
from lmdbstore.errors import LmdbStoreError, StoreExistsError, clip, preview
from lmdbstore.loader.choose import SplitRecord, split_indices
from lmdbstore.store.metaview import check_in_range, sample_indices
from lmdbstore.store.readers import Reader, as_reader
from lmdbstore.tools.export_formats import ExportData, Progress, export_paths, format_of, write_export
from lmdbstore.util.atomic import atomic_paths
from lmdbstore.util.memory import clip_count
from lmdbstore.util.paths import check_output_file

__all__ = ["ExportReport", "export_store", "load_indices", "select_indices"]


# ---------------------------------------------------------------------------------------------- selection
def load_indices(path: str | os.PathLike[str]) -> np.ndarray:
    """Sample indices from a file: an ``.npy`` 1-D integer array, or text with one index per line.

    Raises:
        ValueError: the file is missing, unreadable, not 1-D integers, or has a non-integer line.
    """
    p = Path(path)
    try:
        if p.suffix.lower() == ".npy":
            arr = np.load(p, allow_pickle=False, mmap_mode="r")
        else:
            arr = np.loadtxt(p, dtype=np.int64, ndmin=1, comments="#")
    except (OSError, ValueError) as exc:
        raise ValueError(f"indices: cannot read {p} ({' '.join(str(exc).split())})") from exc
    if arr.ndim != 1:
        raise ValueError(f"indices: {p} must hold a 1-D array of sample indices, got shape {arr.shape}")
    return sample_indices(arr)  # integers only, as every index argument


def _class_ids(classes: Sequence[str | int], names: Sequence[str]) -> list[int]:
    ids: list[int] = []
    for c in classes:
        if isinstance(c, str) and c in names:
            ids.append(list(names).index(c))
        elif isinstance(c, (int, np.integer)) and not isinstance(c, bool) and 0 <= c < len(names):
            ids.append(int(c))
        else:
            raise ValueError(f"classes: unknown class {clip(c)!r}; the store has {preview(names)}")
    if len(set(ids)) != len(ids):
        raise ValueError("classes: a class is given twice")
    return sorted(ids)


def select_indices(
    reader: Reader,
    *,
    classes: Sequence[str | int] | None = None,
    split: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = LoaderConfig.seed,
    indices: Any = None,
    recorded: Sequence[SplitRecord] | None = None,
) -> tuple[np.ndarray, list[int]]:
    """The sample indices a selection picks, and the class ids it keeps (ascending).

    Args:
        classes: keep only these classes (names or ids); default all.
        split: ``"train"`` or ``"val"``: that part of the split ``lmdbstore train`` draws with ``val_fraction`` and
            ``seed`` (defaults as ``train``'s).
        indices: explicit sample indices (kept in the given order, repeats allowed); default all.
        recorded: a training run's split records (:func:`~lmdbstore.loader.choose.recorded_splits`): ``split``
            is then that run's part exactly (on a store that grew since too), not one drawn over the store as it is.

    Returns:
        ``(indices, class_ids)``; without ``indices`` the selected indices are ascending.

    Raises:
        ValueError: an unknown class, split or fraction; IndexError: an index outside the store.
        LmdbStoreError: the store changed since the run of ``recorded``.
    """
    names = reader.classes
    keep = _class_ids(classes, names) if classes is not None else list(range(len(names)))
    n = len(reader)
    if indices is not None:
        idx = sample_indices(indices)
        check_in_range(idx, n)
    else:
        idx = np.arange(n, dtype=np.int64)
    if classes is not None and len(keep) < len(names):
        idx = idx[np.isin(reader.labels_of(idx), np.asarray(keep))] if idx.size else idx
    if split is not None:
        part = split_indices(reader.labels(), split, val_fraction, seed, recorded=recorded, path=reader.path)
        idx = idx[np.isin(idx, part, assume_unique=False)]
    return idx, keep


# ---------------------------------------------------------------------------------------------- export
@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_store` wrote."""

    files: list[str]
    format: str
    samples: int
    classes: list[str]
    bytes: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def export_store(
    store: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    fmt: str | None = None,
    compress: bool = DEFAULT_COMPRESS,
    overwrite: bool = False,
    chunk: int = DEFAULT_EXPORT_CHUNK,
    progress: Progress | None = None,
    **selection: Any,
) -> ExportReport:
    """Write a selection of ``store`` (see :func:`select_indices`) to ``out``, streamed.

    Args:
        store: the store directory, or a list of them exported as one set (:class:`~lmdbstore.store.multi.StoreSet`).
        out: the output file; its suffix picks the format unless ``fmt`` (``npy``, ``npz``, ``h5``) is given.
        selection: :func:`select_indices`' keywords ``classes``, ``split``, ``val_fraction``, ``seed``, ``indices``,
            ``recorded`` (default: every sample, index order).
        compress: deflate the ``.npz`` members / gzip the HDF5 samples (default: stored, as ``np.savez``).
        overwrite: replace existing output files (default: refuse).
        chunk: samples read and written per step (default ``DEFAULT_EXPORT_CHUNK``, 16 Ki; memory is
            about ``chunk * sample_bytes``: at most the selection, and clipped with a
            :class:`~lmdbstore.util.memory.MemoryBoundWarning` beyond half the available memory).
        progress: called with the number of samples written after each chunk.

    Raises:
        ValueError / IndexError: a bad selection or argument (TypeError: an unknown keyword).
        StoreExistsError: the output exists.
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
        LmdbStoreError: HDF5 output without h5py; the output directory is missing; the output is a directory, a
            device, a FIFO or a socket, or is (or lies inside) a store read.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    out_p = Path(out)
    kind = format_of(out_p, fmt)
    paths = export_paths(out_p, kind)
    stores = [store] if isinstance(store, (str, os.PathLike)) else list(store)
    for p in paths:  # a file of its own: no device, FIFO or directory, nothing inside a store read
        check_output_file(p, "output", sources=stores)
        if p.exists() and not overwrite:
            raise StoreExistsError("output exists", path=p, hint="remove it or pass overwrite=True")
    t0 = time.perf_counter()
    with as_reader(store) as r:
        idx, keep = select_indices(r, **selection)
        # one chunk in memory at a time: no more than the selection, nor than the machine can give (warned)
        chunk = clip_count(
            min(chunk, max(len(idx), 1)), r.meta.sample_bytes, what="samples per chunk", parameter="chunk", stacklevel=3
        )
        names = [r.classes[c] for c in keep]
        remap = np.full(len(r.classes), 0, r.meta.label_dtype)
        remap[keep] = np.arange(len(keep))
        chunks = (r.read_batch(idx[lo : lo + chunk]) for lo in range(0, len(idx), chunk))
        data = ExportData(chunks, (len(idx), *r.shape), r.dtype, remap[r.labels_of(idx)], names, progress, compress)
        with atomic_paths(paths) as tmps:  # renamed into place only if the export succeeds
            try:
                write_export(kind, tmps, data)
            except OSError as exc:  # an unwritable place (/proc), a full disk: one line naming the output
                raise LmdbStoreError(f"cannot write the export ({exc.strerror or exc})", path=out_p) from exc
    size = sum(p.stat().st_size for p in paths)
    return ExportReport([str(p) for p in paths], kind, len(idx), names, size, time.perf_counter() - t0)
