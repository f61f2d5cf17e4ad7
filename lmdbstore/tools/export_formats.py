"""The output formats of :func:`~lmdbstore.tools.export.export_store`: which files each writes, and the writers.

Every writer has one shape, ``writer(tmps, data)``: it writes the :class:`ExportData` to the temporary
paths ``tmps`` (one per file of :func:`export_paths`, renamed into place by the caller once all succeed),
streaming the samples chunk by chunk so memory stays at one chunk.  Layouts (each ingests again, bit for bit):

``.npy``
    ``OUT.npy`` holds the samples ``(N, *shape)`` in the store's dtype; ``OUT.labels.npy`` the class
    ids (the store's compact label dtype) and ``OUT.classes.json`` the class names they index.
``.npz``
    Members ``x`` (samples), ``y`` (class ids) and ``class_names``, exactly what ``ingest`` reads.
``.h5`` / ``.hdf5``
    Datasets ``x`` (chunked), ``y`` and ``class_names`` (needs ``h5py``: ``pip install 'lmdbstore[hdf5]'``).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from numpy.lib import format as npformat

from lmdbstore.config import DEFAULT_COMPRESS
from lmdbstore.errors import LmdbStoreError

__all__ = ["EXPORT_FORMATS", "ExportData", "Progress", "export_paths", "format_of", "write_export"]

#: Output formats and the suffixes that imply them.
EXPORT_FORMATS = {"npy": (".npy",), "npz": (".npz",), "h5": (".h5", ".hdf5")}
#: Bytes per HDF5 chunk of samples (about; at least one sample).
H5_CHUNK_BYTES = 1 << 20

#: Called with the number of samples written after each chunk.
Progress = Callable[[int], Any]


@dataclass(frozen=True)
class ExportData:
    """What every format writes: the selected samples as ``chunks`` (arrays ``(k, *shape)`` in output order,
    consumed once) of ``shape`` ``(N, *sample shape)`` in the store's ``dtype``, their ``N`` class ids
    ``labels`` indexing the names ``classes``; ``progress(samples written)`` after each chunk; ``compress``:
    deflate ``.npz`` members / gzip HDF5 samples (ignored by ``.npy``)."""

    chunks: Iterator[np.ndarray]
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    labels: np.ndarray
    classes: list[str]
    progress: Progress | None = None
    compress: bool = DEFAULT_COMPRESS

    def written(self) -> Iterator[np.ndarray]:
        """The chunks, reporting each to ``progress`` once the caller has written it (asks for the next)."""
        for x in self.chunks:
            yield x
            if self.progress is not None:
                self.progress(len(x))


def format_of(out: Path, fmt: str | None) -> str:
    """The format of an export to ``out``: ``fmt`` when given, else the one ``out``'s suffix implies.

    Raises:
        ValueError: an unknown ``fmt``, or no ``fmt`` and a suffix no format has.
    """
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
    """The files an export to ``out`` writes (``.npy`` writes three, the others one).

    Raises:
        ValueError: as :func:`format_of`.
    """
    p = Path(out)
    if format_of(p, fmt) != "npy":
        return [p]
    stem = p.with_suffix("") if p.suffix.lower() == ".npy" else p
    return [p, stem.with_name(stem.name + ".labels.npy"), stem.with_name(stem.name + ".classes.json")]


def _write_npy_stream(fp: BinaryIO, data: ExportData) -> None:
    """An ``.npy`` of all the samples: the header, then each chunk's bytes as it comes."""
    header = {"descr": npformat.dtype_to_descr(data.dtype), "fortran_order": False, "shape": data.shape}
    try:
        npformat.write_array_header_1_0(fp, header)
    except ValueError:  # header too long for format 1.0
        npformat.write_array_header_2_0(fp, header)
    for x in data.written():
        fp.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)


def _write_npy(tmps: list[Path], data: ExportData) -> None:
    with open(tmps[0], "wb") as fp:
        _write_npy_stream(fp, data)
        fp.flush()
        os.fsync(fp.fileno())
    with open(tmps[1], "wb") as fy:  # a file object: np.save would append .npy to the temporary name
        np.save(fy, data.labels, allow_pickle=False)
    tmps[2].write_text(json.dumps(data.classes) + "\n")


def _write_npz(tmps: list[Path], data: ExportData) -> None:
    mode = zipfile.ZIP_DEFLATED if data.compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(tmps[0], "w", compression=mode, allowZip64=True) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as fp:
            _write_npy_stream(fp, data)  # type: ignore[arg-type]
        for name, arr in (("y.npy", data.labels), ("class_names.npy", np.asarray(data.classes, dtype=str))):
            with zf.open(name, "w", force_zip64=True) as fp:
                npformat.write_array(fp, arr, allow_pickle=False)  # type: ignore[arg-type]


def _write_h5(tmps: list[Path], data: ExportData) -> None:
    try:
        import h5py
    except ImportError as exc:
        raise LmdbStoreError("writing HDF5 needs the h5py package", hint="pip install 'lmdbstore[hdf5]'") from exc
    shape = data.shape
    with h5py.File(tmps[0], "w") as f:
        rows = max(1, min(shape[0], H5_CHUNK_BYTES // max(1, int(np.prod(shape[1:])) * data.dtype.itemsize)))
        ds = f.create_dataset(
            "x",
            shape=shape,
            dtype=data.dtype,
            chunks=(rows, *shape[1:]) if shape[0] else None,
            compression="gzip" if data.compress else None,
        )
        pos = 0
        for x in data.written():
            ds[pos : pos + len(x)] = x
            pos += len(x)
        f.create_dataset("y", data=data.labels)
        f.create_dataset("class_names", data=data.classes, dtype=h5py.string_dtype())


#: format -> its writer (one per key of EXPORT_FORMATS)
_WRITERS: dict[str, Callable[[list[Path], ExportData], None]] = {"npy": _write_npy, "npz": _write_npz, "h5": _write_h5}
assert set(_WRITERS) == set(EXPORT_FORMATS)


def write_export(kind: str, tmps: list[Path], data: ExportData) -> None:
    """Write ``data`` in format ``kind`` to ``tmps``, the temporary names of :func:`export_paths`'s files.

    Raises:
        LmdbStoreError: HDF5 without h5py.  OSError: the files cannot be written.
    """
    _WRITERS[kind](tmps, data)
