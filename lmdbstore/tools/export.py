"""Getting data back out of a store: :func:`export_store` to ``.npy``/``.npz``/HDF5, :func:`copy_store`.

Exports stream: samples are read in chunks of ``chunk`` samples (in index order, so each packed value
is looked up once) and written straight to the output file, so memory stays at one chunk plus the
O(samples) index and label tables, whatever the store's size.  The output is written under a
temporary name and renamed into place at the end: an export that fails leaves no partial file.

What is exported is a :func:`select_indices` selection: every sample, or only some classes, the train
or validation part of the same seeded stratified split ``lmdbstore train`` uses, or the indices listed
in a file -- or an intersection of these.

Layouts (each can be ingested again, bit for bit):

``.npy``
    ``OUT.npy`` holds the samples ``(N, *shape)`` in the store's dtype; ``OUT.labels.npy`` the class
    ids (the store's compact label dtype) and ``OUT.classes.json`` the class names they index.
``.npz``
    Members ``x`` (samples), ``y`` (class ids) and ``class_names``, exactly what ``ingest`` reads.
``.h5`` / ``.hdf5``
    Datasets ``x`` (chunked), ``y`` and ``class_names`` (needs ``h5py``: ``pip install 'lmdbstore[hdf5]'``).

With a class selection the output's ``class_names`` are the selected classes (in store order) and the
ids are renumbered to index them, so ingesting the export gives a store of just those classes.

:func:`copy_store` is LMDB's own consistent copy (``mdb_env_copy2``), optionally compacting: it reads
one snapshot under a registered read transaction, so it is safe while readers and a writer run.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from numpy.lib import format as npformat

from lmdbstore.errors import LmdbStoreError, StoreExistsError, clip, preview, translate_lmdb_errors
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.store.env import DATA_FILE, begin_read, check_store_dir, open_env, read_meta
from lmdbstore.store.reader import StoreReader
from lmdbstore.util.atomic import atomic_paths, fsync_path, temp_beside

__all__ = [
    "EXPORT_FORMATS",
    "CopyReport",
    "ExportReport",
    "copy_store",
    "export_paths",
    "export_store",
    "load_indices",
    "select_indices",
]

#: Output formats and the suffixes that imply them.
EXPORT_FORMATS = {"npy": (".npy",), "npz": (".npz",), "h5": (".h5", ".hdf5")}
#: Samples read and written per step (64 Ki samples of 25x25 float32 = 160 MiB would be too much; 16 Ki = 40 MiB).
DEFAULT_EXPORT_CHUNK = 16384
SPLITS = ("train", "val")

Progress = Callable[[int], Any]


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
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"indices: {p} must hold a 1-D array of integers, got {arr.dtype} {arr.shape}")
    return np.asarray(arr, dtype=np.int64)


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
    reader: StoreReader,
    *,
    classes: Sequence[str | int] | None = None,
    split: str | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    indices: Any = None,
) -> tuple[np.ndarray, list[int]]:
    """The sample indices a selection picks, and the class ids it keeps (ascending).

    Args:
        reader: an open store.
        classes: keep only these classes (names or ids); default all.
        split: ``"train"`` or ``"val"``: that part of ``stratified_split(labels, val_fraction, seed)``,
            the same split ``lmdbstore train --val-fraction F --seed S`` trains and validates on.
        val_fraction, seed: the split's parameters.
        indices: explicit sample indices (kept in the given order, repeats allowed); default all.

    Returns:
        ``(indices, class_ids)``; without ``indices`` the selected indices are ascending.

    Raises:
        ValueError: an unknown class, split or fraction; IndexError: an index outside the store.
    """
    names = reader.classes
    keep = _class_ids(classes, names) if classes is not None else list(range(len(names)))
    n = len(reader)
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if indices is not None:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise IndexError(f"indices: sample index {bad} out of range for a store of {n} samples")
    else:
        idx = np.arange(n, dtype=np.int64)
    if classes is not None and len(keep) < len(names):
        idx = idx[np.isin(reader.labels_of(idx), np.asarray(keep))] if idx.size else idx
    if split is not None:
        train_idx, val_idx = stratified_split(reader.labels(), val_fraction, seed)
        part = train_idx if split == "train" else val_idx
        idx = idx[np.isin(idx, part, assume_unique=False)]
    return idx, keep


# ---------------------------------------------------------------------------------------------- outputs
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


def _format_of(out: Path, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"fmt must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
        return fmt
    suffix = out.suffix.lower()
    for name, suffixes in EXPORT_FORMATS.items():
        if suffix in suffixes:
            return name
    raise ValueError(f"out: cannot tell the format from {out.name!r}; end it in .npy, .npz, .h5 or .hdf5")


def export_paths(out: str | os.PathLike[str], fmt: str | None = None) -> list[Path]:
    """The files an export to ``out`` writes (``.npy`` writes three, the others one)."""
    p = Path(out)
    if _format_of(p, fmt) != "npy":
        return [p]
    stem = p.with_suffix("") if p.suffix.lower() == ".npy" else p
    return [p, stem.with_name(stem.name + ".labels.npy"), stem.with_name(stem.name + ".classes.json")]


def _npy_header(fp: BinaryIO, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    d = {"descr": npformat.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        npformat.write_array_header_1_0(fp, d)
    except ValueError:  # header too long for format 1.0
        npformat.write_array_header_2_0(fp, d)


def _chunks(reader: StoreReader, idx: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
    for lo in range(0, len(idx), chunk):
        yield reader.read_batch(idx[lo : lo + chunk])


@contextmanager
def _atomic(paths: list[Path], overwrite: bool) -> Iterator[list[Path]]:
    """Temporary names for ``paths``, renamed into place only if the block succeeds."""
    for p in paths:
        if p.exists() and not overwrite:
            raise StoreExistsError("output exists", path=p, hint="remove it or pass --force (overwrite=True)")
        if not p.parent.is_dir():
            raise LmdbStoreError("output directory does not exist", path=p.parent)
    with atomic_paths(paths) as tmps:
        yield tmps


def _write_npy_stream(
    fp: BinaryIO, shape: tuple[int, ...], dtype: np.dtype[Any], chunks: Iterator[np.ndarray], progress: Progress | None
) -> None:
    _npy_header(fp, shape, dtype)
    for x in chunks:
        fp.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)
        if progress is not None:
            progress(len(x))


def _write_npy(
    tmps: list[Path],
    chunks: Iterator[np.ndarray],
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    y: np.ndarray,
    names: list[str],
    progress: Progress | None,
) -> None:
    with open(tmps[0], "wb") as fp:
        _write_npy_stream(fp, shape, dtype, chunks, progress)
        fp.flush()
        os.fsync(fp.fileno())
    with open(tmps[1], "wb") as fy:  # a file object: np.save would append .npy to the temporary name
        np.save(fy, y, allow_pickle=False)
    tmps[2].write_text(json.dumps(names) + "\n")


def _write_npz(
    tmp: Path,
    chunks: Iterator[np.ndarray],
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    y: np.ndarray,
    names: list[str],
    progress: Progress | None,
    compress: bool,
) -> None:
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(tmp, "w", compression=mode, allowZip64=True) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as fp:
            _write_npy_stream(fp, shape, dtype, chunks, progress)  # type: ignore[arg-type]
        for name, arr in (("y.npy", y), ("class_names.npy", np.asarray(names, dtype=str))):
            with zf.open(name, "w", force_zip64=True) as fp:
                npformat.write_array(fp, arr, allow_pickle=False)  # type: ignore[arg-type]


def _write_h5(
    tmp: Path,
    chunks: Iterator[np.ndarray],
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    y: np.ndarray,
    names: list[str],
    progress: Progress | None,
    compress: bool,
) -> None:
    try:
        import h5py
    except ImportError as exc:
        raise LmdbStoreError("writing HDF5 needs the h5py package", hint="pip install 'lmdbstore[hdf5]'") from exc
    with h5py.File(tmp, "w") as f:
        rows = max(1, min(shape[0], (1 << 20) // max(1, int(np.prod(shape[1:])) * dtype.itemsize)))
        ds = f.create_dataset(
            "x",
            shape=shape,
            dtype=dtype,
            chunks=(rows, *shape[1:]) if shape[0] else None,
            compression="gzip" if compress else None,
        )
        pos = 0
        for x in chunks:
            ds[pos : pos + len(x)] = x
            pos += len(x)
            if progress is not None:
                progress(len(x))
        f.create_dataset("y", data=y)
        f.create_dataset("class_names", data=names, dtype=h5py.string_dtype())


def export_store(
    store: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fmt: str | None = None,
    classes: Sequence[str | int] | None = None,
    split: str | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    indices: Any = None,
    compress: bool = False,
    overwrite: bool = False,
    chunk: int = DEFAULT_EXPORT_CHUNK,
    progress: Progress | None = None,
) -> ExportReport:
    """Write a selection of ``store`` (see :func:`select_indices`) to ``out``, streamed.

    Args:
        store: the store directory.
        out: the output file; its suffix picks the format unless ``fmt`` (``npy``, ``npz``, ``h5``) is given.
        classes, split, val_fraction, seed, indices: the selection (default: every sample, index order).
        compress: deflate the ``.npz`` members / gzip the HDF5 samples (default: stored, as ``np.savez``).
        overwrite: replace existing output files (default: refuse).
        chunk: samples read and written per step (memory is about ``chunk * sample_bytes``).
        progress: called with the number of samples written after each chunk.

    Raises:
        ValueError / IndexError: a bad selection or argument.  StoreExistsError: the output exists.
        StoreNotFoundError, NotAStoreError, CorruptStoreError: the store cannot be read.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    out_p = Path(out)
    kind = _format_of(out_p, fmt)
    paths = export_paths(out_p, kind)
    t0 = time.perf_counter()
    with StoreReader(store) as r:
        idx, keep = select_indices(
            r, classes=classes, split=split, val_fraction=val_fraction, seed=seed, indices=indices
        )
        names = [r.classes[c] for c in keep]
        remap = np.full(len(r.classes), 0, r.meta.label_dtype)
        remap[keep] = np.arange(len(keep))
        y = remap[r.labels_of(idx)]
        shape = (len(idx), *r.shape)
        with _atomic(paths, overwrite) as tmps:
            chunks = _chunks(r, idx, chunk)
            if kind == "npy":
                _write_npy(tmps, chunks, shape, r.dtype, y, names, progress)
            elif kind == "npz":
                _write_npz(tmps[0], chunks, shape, r.dtype, y, names, progress, compress)
            else:
                _write_h5(tmps[0], chunks, shape, r.dtype, y, names, progress, compress)
    size = sum(p.stat().st_size for p in paths)
    return ExportReport([str(p) for p in paths], kind, len(idx), names, size, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- copy
@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_store` did: source and copy sizes (bytes of ``data.mdb``), samples, time."""

    source: str
    dest: str
    compact: bool
    samples: int
    source_bytes: int
    dest_bytes: int
    seconds: float


def copy_store(store: str | os.PathLike[str], dest: str | os.PathLike[str], *, compact: bool = False) -> CopyReport:
    """Copy ``store`` to the new directory ``dest`` with LMDB's own consistent copy.

    The copy is of one snapshot, taken under a registered read transaction (``lock=True``), so it is
    consistent while readers and a writer use the store; a writer's later commits are not in it.
    ``compact=True`` omits free pages and renumbers the rest (a smaller file; slower).  The copy is
    made in a temporary directory beside ``dest`` and renamed into place, then fsynced.

    py-lmdb refuses a second environment of one path in a process: close this process's readers of
    ``store`` first (DataLoader workers and other processes are fine).

    Raises:
        StoreExistsError: ``dest`` exists (and is not an empty directory).
        StoreNotFoundError, NotAStoreError, CorruptStoreError, LmdbStoreError: the store cannot be read.
    """
    src, dst = Path(store), Path(dest)
    check_store_dir(src)
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise StoreExistsError("destination exists", path=dst, hint="give a new directory")
    if not dst.parent.is_dir():
        raise LmdbStoreError("destination's parent directory does not exist", path=dst.parent)
    t0 = time.perf_counter()
    try:
        env = open_env(src, readonly=True, lock=True)
    except LmdbStoreError as exc:
        if "already open" in str(exc):
            raise LmdbStoreError(
                str(exc.message), path=src, hint="close this process's readers of the store first"
            ) from exc
        raise
    tmp = temp_beside(dst, "copy")
    try:
        with translate_lmdb_errors(src, "copy"):
            tmp.mkdir()
            env.copy(str(tmp), compact=compact)
        count = _sample_count(tmp)  # of the snapshot the copy took (a writer may have committed since)
        fsync_path(tmp / DATA_FILE)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
        fsync_path(dst.parent)
    finally:
        env.close()
        if tmp.exists():
            for child in tmp.iterdir():
                child.unlink()
            tmp.rmdir()
    return CopyReport(
        str(src),
        str(dst),
        compact,
        count,
        os.path.getsize(src / DATA_FILE),
        os.path.getsize(dst / DATA_FILE),
        time.perf_counter() - t0,
    )


def _sample_count(path: Path) -> int:
    """The sample count a freshly copied store's metadata holds (nobody else has it open yet)."""
    env = open_env(path, readonly=True, lock=False)
    try:
        with translate_lmdb_errors(path, "read the copy"):
            txn = begin_read(env)
            try:
                return read_meta(env, txn, path).count
            finally:
                txn.abort()
    finally:
        env.close()
