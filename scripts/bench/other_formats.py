"""The other storage formats the storage benchmark compares lmdbstore with: the usual ways of storing many
small samples, each behind the :class:`bench.formats.Format` adapter.

* ``lmdb_naive``   one LMDB key per sample holding ``pickle.dumps((x, y))``, read with one ``txn.get`` per
                   sample: how most tutorials do it (the baseline only; lmdbstore never pickles).
* ``h5py_contig``  HDF5 contiguous dataset; per-sample reads (``dset[i]``) and sorted fancy-index batches.
* ``h5py_chunked`` HDF5 chunked dataset (16 samples per chunk, close to lmdbstore's packing), same reads.
* ``sqlite``       one BLOB per row (default page size); per-row SELECTs and one ``IN (...)`` query per batch.
* ``npy_files``    a directory with one ``.npy`` file per sample.

:data:`FORMATS` names every format, these and ``bench.formats``' ``memmap`` and ``lmdbstore``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from bench.common import WRITE_CHUNK, make_log
from bench.formats import Format, LmdbstoreFormat, MemmapFormat

#: Every format, in the order the storage benchmark measures and reports them.
FORMAT_ORDER = ("memmap", "lmdbstore", "lmdb_naive", "h5py_contig", "h5py_chunked", "sqlite", "npy_files")

log = make_log("storage")


class LmdbNaiveFormat(Format):
    name, title = "lmdb_naive", "LMDB, 1 pickle/key"
    modes = ("per-sample",)
    note = "pickle.dumps((x[i], y[i])) per key, one txn.get per sample (tutorial style)"
    txn_size = 10_000

    def key(self, i: int) -> bytes:
        return f"{i:08d}".encode()

    def _build(self, x: np.ndarray, y: np.ndarray) -> None:
        env = lmdb.open(str(self.dir), map_size=max(1 << 26, len(x) * (x[0].nbytes + 2048) * 2))
        try:
            for a in range(0, len(x), self.txn_size):
                with env.begin(write=True) as txn:
                    for i in range(a, min(a + self.txn_size, len(x))):
                        txn.put(self.key(i), pickle.dumps((x[i], int(y[i]))))
        finally:
            env.close()

    def _open(self) -> Any:
        env = lmdb.open(str(self.dir), readonly=True, lock=False, readahead=False, meminit=False)
        return env, env.begin(buffers=False)

    def _close(self, h: Any) -> None:
        h[1].abort()
        h[0].close()

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        _, txn = self.handles()
        items = [pickle.loads(txn.get(self.key(i))) for i in idx.tolist()]
        return np.stack([it[0] for it in items]), np.array([it[1] for it in items], np.uint8)

    def used_bytes(self) -> int | None:
        env = lmdb.open(str(self.dir), readonly=True, lock=False)
        try:
            return int((env.info()["last_pgno"] + 1) * env.stat()["psize"])
        finally:
            env.close()


class H5Format(Format):
    name, title = "h5py_contig", "HDF5 contiguous"
    modes = ("per-sample", "sorted fancy")
    chunks: tuple[int, ...] | None = None
    note = "h5py, dset[i] per sample / dset[sorted idx] per batch"

    def _build(self, x: np.ndarray, y: np.ndarray) -> None:
        import h5py

        with h5py.File(self.dir / "data.h5", "w") as f:
            dx = f.create_dataset("x", shape=x.shape, dtype=x.dtype, chunks=self.chunk_shape(x))
            for a in range(0, len(x), WRITE_CHUNK):
                dx[a : a + WRITE_CHUNK] = x[a : a + WRITE_CHUNK]
            f.create_dataset("y", data=y)

    def chunk_shape(self, x: np.ndarray) -> tuple[int, ...] | None:
        return None

    def _open(self) -> Any:
        import h5py

        f = h5py.File(self.dir / "data.h5", "r")
        return f, f["x"], f["y"][:]

    def _close(self, h: Any) -> None:
        h[0].close()

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        _, dx, y = self.handles()
        if mode == "per-sample":
            return np.stack([dx[i] for i in idx.tolist()]), y[idx]
        uniq, inverse = np.unique(idx, return_inverse=True)  # h5py wants increasing indices
        return dx[uniq][inverse.reshape(-1)], y[idx]


class H5ChunkedFormat(H5Format):
    name, title = "h5py_chunked", "HDF5 chunked"
    note = "h5py, chunks of 16 samples (40 KB), no compression"

    def chunk_shape(self, x: np.ndarray) -> tuple[int, ...] | None:
        return (min(16, len(x)), *x.shape[1:])


class SqliteFormat(Format):
    name, title = "sqlite", "SQLite BLOB/row"
    modes = ("per-sample", "IN batch")
    note = "one BLOB per row, default 4 KiB pages, SELECT per row / WHERE id IN (...) per batch"
    max_vars = 30_000

    def _build(self, x: np.ndarray, y: np.ndarray) -> None:
        con = sqlite3.connect(self.dir / "data.db")
        try:
            con.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, label INTEGER NOT NULL, x BLOB NOT NULL)")
            for a in range(0, len(x), WRITE_CHUNK):
                b = min(a + WRITE_CHUNK, len(x))
                with con:
                    con.executemany(
                        "INSERT INTO samples VALUES (?, ?, ?)",
                        ((i, int(y[i]), x[i].tobytes()) for i in range(a, b)),
                    )
        finally:
            con.close()

    def _open(self) -> Any:
        return sqlite3.connect(f"file:{self.dir / 'data.db'}?mode=ro", uri=True, check_same_thread=False)

    def _close(self, h: Any) -> None:
        h.close()

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        con = self.handles()
        shape = self.shape
        if mode == "per-sample":
            rows = [con.execute("SELECT label, x FROM samples WHERE id = ?", (i,)).fetchone() for i in idx.tolist()]
            labels = np.array([r[0] for r in rows], np.uint8)
            return np.frombuffer(b"".join(r[1] for r in rows), np.float32).reshape(len(idx), *shape), labels
        uniq, inverse = np.unique(idx, return_inverse=True)
        labels_u = np.empty(len(uniq), np.uint8)
        blobs: list[bytes] = []
        u = uniq.tolist()
        for a in range(0, len(u), self.max_vars):
            part = u[a : a + self.max_vars]
            q = f"SELECT label, x FROM samples WHERE id IN ({','.join('?' * len(part))}) ORDER BY id"
            rows = con.execute(q, part).fetchall()
            labels_u[a : a + len(rows)] = [r[0] for r in rows]
            blobs.extend(r[1] for r in rows)
        xu = np.frombuffer(b"".join(blobs), np.float32).reshape(len(uniq), *shape)
        inv = inverse.reshape(-1)
        return xu[inv], labels_u[inv]


class NpyFilesFormat(Format):
    name, title = "npy_files", "per-sample .npy"
    modes = ("per-sample",)
    note = "one .npy file per sample + labels.npy"

    def _build(self, x: np.ndarray, y: np.ndarray) -> None:
        d = self.dir / "samples"
        d.mkdir()
        for i in range(len(x)):
            np.save(d / f"{i:08d}.npy", x[i])
        np.save(self.dir / "labels.npy", y)

    def _open(self) -> Any:
        return self.dir / "samples", np.load(self.dir / "labels.npy")

    def remove(self) -> None:
        """Delete the files; many of them go to a background ``rm`` (unlinking tens of thousands of
        small files can take minutes on some filesystems, e.g. ext4 mounted with ``discard``)."""
        self.close()
        if not self.dir.exists():
            return
        if self.n <= 2000:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        trash = self.dir.parent.parent / f".bench_trash_{os.getpid()}_{time.time_ns()}"
        os.rename(self.dir, trash)
        subprocess.Popen(
            ["rm", "-rf", str(trash)],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        log(f"npy_files: deleting {self.n:,} files in the background ({trash})")

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        d, y = self.handles()
        return np.stack([np.load(d / f"{i:08d}.npy") for i in idx.tolist()]), y[idx]


FORMATS: dict[str, type[Format]] = {
    cls.name: cls
    for cls in (MemmapFormat, LmdbstoreFormat, LmdbNaiveFormat, H5Format, H5ChunkedFormat, SqliteFormat, NpyFilesFormat)
}


def make_format(name: str, root: Path) -> Format:
    """The adapter for format ``name`` keeping its files under ``root / name``."""
    if name not in FORMATS:
        raise ValueError(f"formats: unknown format {name!r}; choose from {', '.join(FORMATS)}")
    return FORMATS[name](root)
