#!/usr/bin/env python
"""Side-by-side storage benchmark: lmdbstore against the usual ways of storing many small samples.

The same synthetic dataset (default 1M samples of 25x25 float32, 5 classes) is written in each format
and read back the way a training loop reads it: random batches of 4096.  Formats:

* ``memmap``       one ``.npy`` file written by ``np.save`` and read through ``np.load(mmap_mode="r")``:
                   the raw sequential write rate and the physical in-cache read baseline.
* ``lmdbstore``    this library (``open_writer`` / ``StoreReader.read_batch``), random and block order.
* ``lmdb_naive``   one LMDB key per sample holding ``pickle.dumps((x, y))``, read with one ``txn.get`` per
                   sample: how most tutorials do it (the baseline only; lmdbstore never pickles).
* ``h5py_contig``  HDF5 contiguous dataset; per-sample reads (``dset[i]``) and sorted fancy-index batches.
* ``h5py_chunked`` HDF5 chunked dataset (16 samples per chunk, close to lmdbstore's packing), same reads.
* ``sqlite``       one BLOB per row (default page size); per-row SELECTs and one ``IN (...)`` query per batch.
* ``npy_files``    a directory with one ``.npy`` file per sample, at a smaller size (default 50k).

Measured for each: ingest samples/s (including the final fsync), bytes on disk (allocated blocks) per
sample against the raw 2,500 bytes, warm random-batch read samples/s in one process and through a
DataLoader with 2 workers, and cold-cache reads after ``posix_fadvise(DONTNEED)`` on the format's files.
A scaling run then builds lmdbstore stores of 0.1M, 1M and 5M samples and measures, in a fresh reader
process, random-read samples/s, peak memory and the B-tree depth.

Usage::

    python scripts/bench.py                      # full run (a few minutes), results in ./bench_out
    python scripts/bench.py --quick --out /tmp/b  # seconds; a smoke test
    python scripts/bench.py --n 200000 --formats memmap,lmdbstore,h5py_contig --scaling-sizes none

Outputs under ``--out``: ``bench_results.csv``, ``bench_scaling.csv``, ``bench_results.json`` and
``bench_read_throughput.png`` (when matplotlib is installed).  Data files go to ``--data-dir``
(default ``OUT/data``) and are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import functools
import json
import math
import os
import pickle
import platform
import resource
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

import lmdbstore
from lmdbstore.loader.samplers import block_order
from lmdbstore.store.reader import StoreReader

PAGE = os.sysconf("SC_PAGE_SIZE")
WRITE_CHUNK = 65536
FORMAT_ORDER = ("memmap", "lmdbstore", "lmdb_naive", "h5py_contig", "h5py_chunked", "sqlite", "npy_files")
DEFAULT_SCALING = (100_000, 1_000_000, 5_000_000)


# ============================================================================ small helpers
def log(msg: str) -> None:
    """Progress line on stderr (the results go to stdout)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def human(v: float | None, unit: str = "") -> str:
    """Compact number: 1.23M, 456k, 7.8 (``-`` for missing)."""
    if v is None or v != v:
        return "-"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}{unit}"
    return f"{v:.3g}{unit}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def files_under(path: Path) -> list[Path]:
    """Every regular file below ``path`` (or ``path`` itself)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def allocated_bytes(path: Path) -> int:
    """Bytes of disk blocks allocated to ``path`` and everything below it (directories included)."""
    total = path.stat().st_blocks * 512
    if path.is_dir():
        for p in path.rglob("*"):
            total += p.lstat().st_blocks * 512
    return total


_libc: Any = None


def _get_libc() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        libc.syncfs.argtypes = [ctypes.c_int]
        _libc = libc
    return _libc


def resident_fraction(paths: Sequence[Path]) -> float | None:
    """Share of the files' pages that are in the page cache (mincore); ``None`` if it cannot tell."""
    try:
        libc = _get_libc()
    except OSError:
        return None
    total = resident = 0
    map_failed = ctypes.c_void_p(-1).value
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        pages = (size + PAGE - 1) // PAGE
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, map_failed):
                return None
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            libc.munmap(ctypes.c_void_p(addr), size)
            if not ok:
                return None
            resident += int((np.ctypeslib.as_array(vec) & 1).sum())
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else None


def flush_to_disk(path: Path) -> None:
    """Make everything under ``path`` durable: fsync each file, or syncfs for directories of many files."""
    paths = files_under(path)
    if len(paths) > 256:
        fd = os.open(path, os.O_RDONLY)
        try:
            _get_libc().syncfs(fd)
        finally:
            os.close(fd)
        return
    for p in [*paths, path if path.is_dir() else path.parent]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache(paths: Sequence[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (clean, unmapped pages only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(paths: Sequence[Path]) -> float:
    """Read the files sequentially (into the page cache) unless they are already resident; returns seconds."""
    frac = resident_fraction(paths)
    if frac is not None and frac > 0.99:
        return 0.0
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def rss_status() -> dict[str, float]:
    """VmRSS / RssAnon / RssFile / VmHWM of this process in MiB, from /proc/self/status (Linux)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024
    return out


# ============================================================================ machine description
def host_facts() -> dict[str, Any]:
    """Platform, Python, CPU model, logical CPUs and RAM: what every benchmark reports of its machine."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    info["cpu"] = info.get("cpu") or platform.processor() or "unknown"
    info["cores"] = os.cpu_count()
    with contextlib.suppress(ValueError, AttributeError, OSError):
        info["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return info


def machine_info(data_dir: Path) -> dict[str, Any]:
    """CPU, memory, filesystem of the data directory and library versions."""
    info = host_facts()
    info["filesystem"] = _filesystem_of(data_dir)
    usage = shutil.disk_usage(data_dir)
    info["disk_free_gib"] = round(usage.free / 2**30, 1)
    versions = {"numpy": np.__version__, "lmdb (py)": lmdb.__version__, "lmdbstore": lmdbstore.__version__}
    versions["liblmdb"] = ".".join(map(str, lmdb.version()))
    versions["sqlite"] = sqlite3.sqlite_version
    for mod in ("torch", "h5py"):
        try:
            m = __import__(mod)
            versions[mod] = m.__version__
            if mod == "h5py":
                versions["hdf5"] = m.version.hdf5_version
        except ImportError:
            versions[mod] = "not installed"
    info["versions"] = versions
    info["lmdbstore_source"] = _source_state(Path(lmdbstore.__file__).resolve().parent)
    return info


def _source_state(pkg: Path) -> str:
    """Git commit of the lmdbstore sources and whether they have uncommitted changes (results depend on it)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(pkg), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(pkg), "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if commit.returncode != 0:
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty.stdout.splitlines() if line.strip()]
    return commit.stdout.strip() + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def _filesystem_of(path: Path) -> str:
    """'<fstype> on <device> (<mount point>)' for the mount holding ``path``."""
    best = ("", "?", "?")
    target = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, *_ = line.split()
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    rot = ""
    dev_name = Path(best[1]).name
    with contextlib.suppress(OSError):
        rot = f" (rotational={Path(f'/sys/block/{dev_name}/queue/rotational').read_text().strip()})"
    return f"{best[2]} on {best[1]}{rot} (mounted at {best[0]})"


def describe_machine(info: dict[str, Any]) -> str:
    v = info["versions"]
    return "\n".join(
        [
            f"Machine: {info['cpu']}, {info['cores']} cores, {info.get('ram_gib', '?')} GiB RAM",
            f"Disk:    {info['filesystem']}, {info['disk_free_gib']} GiB free",
            f"OS:      {info['platform']}",
            "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + f", python {info['python']}",
            f"lmdbstore source: {info.get('lmdbstore_source', 'unknown')}",
        ]
    )


# ============================================================================ data
def make_data(n: int, shape: tuple[int, ...], n_classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` standard-normal float32 samples (z-scored like the reference data) and uint8 labels."""
    rng = np.random.default_rng(seed)
    x = np.empty((n, *shape), np.float32)
    for a in range(0, n, WRITE_CHUNK):
        b = min(a + WRITE_CHUNK, n)
        rng.standard_normal(dtype=np.float32, out=x[a:b])
    y = rng.integers(0, n_classes, n).astype(np.uint8)
    return x, y


def random_batches(n: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches of distinct random indices (successive permutations of ``range(n)``)."""
    rng = np.random.default_rng([seed, 0xBA7C])
    out: list[np.ndarray] = []
    perm = rng.permutation(n)
    pos = 0
    while len(out) < count:
        if pos + batch > n:
            if pos == 0:  # fewer samples than one batch: batches of everything
                out.append(perm.copy())
                continue
            perm, pos = rng.permutation(n), 0
        out.append(perm[pos : pos + batch])
        pos += batch
    return out


def block_batches(n: int, spv: int, batch: int, block_buffer: int, count: int, seed: int) -> list[np.ndarray]:
    """``count`` batches in lmdbstore's block order (``samplers.block_order``), epoch after epoch."""
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < count:
        order = block_order(np.arange(n), spv, batch, block_buffer, np.random.default_rng([seed, epoch]))
        out.extend(order[i : i + batch] for i in range(0, n, batch))
        epoch += 1
    return out[:count]


# ============================================================================ format adapters
@dataclass
class BuildStats:
    n: int
    seconds: float
    disk_bytes: int
    used_bytes: int | None = None  # LMDB pages in use (formats that have them)
    extra: dict[str, Any] = field(default_factory=dict)


class Format:
    """One storage format: build it from (x, y), then read batches of (x, y) by index.

    Handles (files, environments, connections) are opened lazily in the process that reads and
    re-opened after a fork, because h5py, sqlite3 and LMDB handles must never cross a fork.
    """

    name = ""
    title = ""
    modes: tuple[str, ...] = ()
    orders: tuple[str, ...] = ("random",)
    note = ""

    def __init__(self, root: Path):
        self.dir = root / self.name
        self.n = 0
        self.shape: tuple[int, ...] = ()
        self._h: Any = None
        self._pid = -1

    # ----- to implement
    def _build(self, x: np.ndarray, y: np.ndarray) -> None:
        raise NotImplementedError

    def _open(self) -> Any:
        raise NotImplementedError

    def _close(self, h: Any) -> None:
        pass

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        """Samples and labels at ``idx`` (in that order) using read method ``mode``."""
        raise NotImplementedError

    def used_bytes(self) -> int | None:
        return None

    # ----- shared
    def build(self, x: np.ndarray, y: np.ndarray) -> BuildStats:
        """Write (x, y) from scratch, flush to disk, and return timing and size."""
        self.close()
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        t0 = time.perf_counter()
        self._build(x, y)
        flush_to_disk(self.dir)
        seconds = time.perf_counter() - t0
        self.n, self.shape = len(x), tuple(x.shape[1:])
        return BuildStats(len(x), seconds, allocated_bytes(self.dir), self.used_bytes())

    def files(self) -> list[Path]:
        return files_under(self.dir)

    def handles(self) -> Any:
        if self._h is None or self._pid != os.getpid():
            self._h = self._open()  # an inherited handle belongs to the parent: drop it unclosed
            self._pid = os.getpid()
        return self._h

    def open(self) -> None:
        self.handles()

    def close(self) -> None:
        if self._h is not None and self._pid == os.getpid():
            self._close(self._h)
        self._h = None

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def loader(self, batches: list[np.ndarray], mode: str, order: str, workers: int) -> Iterable[Any]:
        """A DataLoader over ``batches`` (``batch_size=None``: one ``__getitem__`` per batch)."""
        from torch.utils.data import DataLoader

        self.close()  # nothing open may cross the fork
        ds = _batch_dataset_class()(self, mode)
        kw: dict[str, Any] = {"multiprocessing_context": "fork", "prefetch_factor": 2} if workers else {}
        return DataLoader(ds, sampler=batches, batch_size=None, num_workers=workers, **kw)


_BATCH_DS: Any = None


def _batch_dataset_class() -> Any:
    """The small batch-indexed torch Dataset used for every baseline (torch is imported lazily)."""
    global _BATCH_DS
    if _BATCH_DS is None:
        import torch
        from torch.utils.data import Dataset

        class BatchDataset(Dataset):  # type: ignore[type-arg]
            """``ds[index_array] -> (x, y)`` through a format's ``read_xy``."""

            def __init__(self, fmt: Format, mode: str):
                self.fmt, self.mode = fmt, mode

            def __len__(self) -> int:
                return self.fmt.n

            def __getitem__(self, idx: Any) -> tuple[Any, Any]:
                x, y = self.fmt.read_xy(np.asarray(idx, dtype=np.int64), self.mode)
                if not x.flags.writeable:  # np.frombuffer over bytes: torch wants a writable array
                    x = x.copy()
                return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))

        _BATCH_DS = BatchDataset
    return _BATCH_DS


class MemmapFormat(Format):
    name, title = "memmap", "numpy memmap"
    modes = ("fancy",)
    note = "np.save + np.load(mmap_mode='r'); ingest = raw sequential write"

    def _build(self, x: np.ndarray, y: np.ndarray) -> None:
        np.save(self.dir / "x.npy", x)
        np.save(self.dir / "y.npy", y)

    def _open(self) -> Any:
        return np.load(self.dir / "x.npy", mmap_mode="r"), np.load(self.dir / "y.npy")

    def _close(self, h: Any) -> None:
        mm = h[0]
        if getattr(mm, "_mmap", None) is not None:
            mm._mmap.close()

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.handles()
        return np.asarray(x[idx]), y[idx]


class LmdbstoreFormat(Format):
    name, title = "lmdbstore", "lmdbstore"
    modes = ("read_batch",)
    orders = ("random", "block")
    note = "open_writer (crc32) + StoreReader.read_batch"
    block_buffer = 4

    def _build(self, x: np.ndarray, y: np.ndarray) -> None:
        build_lmdbstore(self.dir, [(x, y)], classes=[f"c{i}" for i in range(int(y.max(initial=0)) + 1)])

    def _open(self) -> Any:
        reader = StoreReader(self.dir)
        return reader, reader.labels()

    def _close(self, h: Any) -> None:
        h[0].close()

    def spv(self) -> int:
        return int(self.handles()[0].meta.samples_per_value)

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        reader, labels = self.handles()
        return reader.read_batch(idx), labels[idx]

    def used_bytes(self) -> int | None:
        with StoreReader(self.dir) as r:
            st = r.env_stats()
        return int((st["info"]["last_pgno"] + 1) * st["psize"])

    def env_stats(self) -> dict[str, Any]:
        with StoreReader(self.dir) as r:
            return r.env_stats()

    def loader(self, batches: list[np.ndarray], mode: str, order: str, workers: int) -> Iterable[Any]:
        """lmdbstore's own pieces: LmdbBatchDataset + EpochBatchSampler + make_loader."""
        from lmdbstore.config import LoaderConfig
        from lmdbstore.loader.dataset import LmdbBatchDataset, make_loader
        from lmdbstore.loader.samplers import EpochBatchSampler

        self.close()
        ds = LmdbBatchDataset(self.dir)
        cfg = LoaderConfig(
            batch_size=len(batches[0]),
            shuffle=order,  # type: ignore[arg-type]
            block_buffer=self.block_buffer,
            workers=workers,
            persistent_workers=False,
            multiprocessing_context="fork" if workers else None,
        )
        sampler = EpochBatchSampler(
            np.arange(ds.count),
            cfg.batch_size,
            shuffle=cfg.shuffle,
            samples_per_value=ds.reader.meta.samples_per_value,
            block_buffer=cfg.block_buffer,
            seed=1,
        )
        ds.reader.close()
        return make_loader(ds, _Epochs(sampler, len(batches)), cfg)  # type: ignore[arg-type]


class _Epochs:
    """Run an EpochBatchSampler epoch after epoch, up to ``max_batches`` batches."""

    def __init__(self, sampler: Any, max_batches: int):
        self.sampler, self.max_batches = sampler, max_batches
        self.batch_size = sampler.batch_size  # make_loader sizes its reusable buffers by it

    def __len__(self) -> int:
        return self.max_batches

    def __iter__(self) -> Iterator[np.ndarray]:
        k, epoch = 0, 0
        while True:
            self.sampler.set_epoch(epoch)
            for b in self.sampler:
                if k >= self.max_batches:
                    return
                yield b
                k += 1
            epoch += 1


def build_lmdbstore(path: Path, parts: Iterable[tuple[np.ndarray, np.ndarray]], classes: Sequence[str]) -> None:
    """Ingest (x, y) parts into a new store through ``open_writer`` in chunks of 64k samples."""
    first = True
    writer: Any = None
    for x, y in parts:
        if first:
            writer = lmdbstore.open_writer(path, shape=x.shape[1:], dtype=x.dtype, classes=classes)
            first = False
        for a in range(0, len(x), WRITE_CHUNK):
            writer.append(x[a : a + WRITE_CHUNK], y[a : a + WRITE_CHUNK])
    if writer is not None:
        writer.close()


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


# ============================================================================ measurements
def window_rate(sizes: Sequence[int], seconds: Sequence[float], window: int = 1) -> float:
    """Median samples/s over consecutive windows of ``window`` batches.

    The machine may be shared: a median over short windows ignores the bursts when another process
    takes the CPU or the disk, where one long average would fold them in.
    """
    if not sizes:
        return float("nan")
    window = max(1, min(window, len(sizes)))
    rates = [
        sum(sizes[i : i + window]) / max(sum(seconds[i : i + window]), 1e-9)
        for i in range(0, len(sizes) - window + 1, window)
    ]
    return float(np.median(rates))


def time_reads(fn: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray], min_time: float) -> float:
    """Samples/s of ``fn`` over ``batches`` (median per batch) after one untimed warm-up batch.

    Stops once ``min_time`` seconds and at least two batches are timed, or when the batches run out
    (``min_time=math.inf`` times them all).
    """
    fn(batches[0])
    sizes: list[int] = []
    secs: list[float] = []
    t_start = time.perf_counter()
    for k, b in enumerate(batches[1:] if len(batches) > 1 else batches):
        t0 = time.perf_counter()
        fn(b)
        t1 = time.perf_counter()
        sizes.append(len(b))
        secs.append(t1 - t0)
        if t1 - t_start >= min_time and k >= 1:
            break
    return window_rate(sizes, secs)


def time_loader(loader: Iterable[Any], warmup: int, min_time: float) -> float:
    """Samples/s through a DataLoader, timed after the first ``warmup`` batches (worker start-up).

    Batches arrive in bursts when several workers finish together, so the rate is the median over
    windows of ``2 * warmup`` batches (``warmup`` is the worker count).
    """
    it = iter(loader)
    sizes: list[int] = []
    secs: list[float] = []
    try:
        for _ in range(warmup):
            next(it)
        t_start = last = time.perf_counter()
        for k, (x, _y) in enumerate(it):
            now = time.perf_counter()
            sizes.append(len(x))
            secs.append(now - last)
            last = now
            if now - t_start >= min_time and k >= 3:
                break
    finally:
        del it  # shuts the workers down
    return window_rate(sizes, secs, window=2 * max(1, warmup))


def time_cold(
    fmt: Format, fn: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray], max_time: float
) -> tuple[float, float | None, float | None]:
    """Random reads right after dropping the format's pages from the page cache.

    Returns (samples/s, resident share before the drop, resident share after it).  Handles are
    closed first (mapped pages cannot be dropped) and opened again before the clock starts.
    """
    fmt.close()
    paths = fmt.files()
    before = resident_fraction(paths)
    drop_page_cache(paths)
    after = resident_fraction(paths)
    fmt.open()
    done, t0 = 0, time.perf_counter()
    for b in batches:
        fn(b)
        done += len(b)
        if time.perf_counter() - t0 >= max_time:
            break
    return done / (time.perf_counter() - t0), before, after


@dataclass
class Row:
    """One line of the result table: a format read with one method in one index order."""

    format: str
    title: str
    mode: str
    order: str
    n: int
    ingest_s: float | None = None
    ingest_sps: float | None = None
    disk_bytes: int | None = None
    disk_per_sample: float | None = None
    disk_vs_raw: float | None = None
    used_per_sample: float | None = None
    read_1p: float | None = None
    read_2w: float | None = None
    cold_1p: float | None = None
    cold_resident_before: float | None = None
    cold_resident_after: float | None = None
    read_1p_vs_memmap: float | None = None
    read_1p_vs_h5py: float | None = None
    read_2w_vs_memmap: float | None = None
    read_2w_vs_h5py: float | None = None
    ingest_vs_npsave: float | None = None
    note: str = ""

    @property
    def label(self) -> str:
        extra = self.mode if self.order == "random" else f"{self.mode}, {self.order} order"
        return f"{self.title} ({extra})"


@dataclass
class Settings:
    n: int
    npy_n: int
    shape: tuple[int, ...]
    n_classes: int
    batch: int
    workers: int
    min_time: float
    cold_batches: int
    cold_max_time: float
    seed: int
    cold: bool


def measure_format(fmt: Format, x: np.ndarray, y: np.ndarray, s: Settings) -> tuple[list[Row], BuildStats]:
    """Build one format and measure every (read method, order) it offers: all warm reads first, then
    the cold-cache reads (so the page cache is filled once)."""
    log(f"{fmt.name}: building {len(x):,} samples")
    stats = fmt.build(x, y)
    raw = len(x) * x[0].nbytes
    log(f"{fmt.name}: built in {stats.seconds:.1f}s ({human(stats.n / stats.seconds)} samples/s)")
    runs: list[tuple[Row, Callable[[np.ndarray], Any], list[np.ndarray]]] = []
    for order in fmt.orders:
        warm, cold = _batches_for(fmt, order, s)
        for mode in fmt.modes:
            row = Row(fmt.name, fmt.title, mode, order, stats.n, note=fmt.note)
            row.ingest_s, row.ingest_sps = stats.seconds, stats.n / stats.seconds
            row.disk_bytes, row.disk_per_sample = stats.disk_bytes, stats.disk_bytes / stats.n
            row.disk_vs_raw = stats.disk_bytes / raw
            if stats.used_bytes is not None:
                row.used_per_sample = stats.used_bytes / stats.n
            warm_s = warm_page_cache(fmt.files())
            if warm_s:
                log(f"{fmt.name}: pre-read files into the page cache in {warm_s:.1f}s")

            fn: Callable[[np.ndarray], Any] = functools.partial(fmt.read_xy, mode=mode)
            row.read_1p = time_reads(fn, warm, s.min_time)
            if s.workers:
                row.read_2w = time_loader(
                    fmt.loader(warm, mode, order, s.workers), warmup=s.workers, min_time=s.min_time * 1.5
                )
            fmt.close()
            log(
                f"{fmt.name} [{mode}, {order}]: 1 proc {human(row.read_1p)}/s, {s.workers} workers {human(row.read_2w)}/s"
            )
            runs.append((row, fn, cold))
    if s.cold:
        for row, fn, cold in runs:
            row.cold_1p, row.cold_resident_before, row.cold_resident_after = time_cold(fmt, fn, cold, s.cold_max_time)
            fmt.close()
            log(f"{fmt.name} [{row.mode}, {row.order}]: cold {human(row.cold_1p)}/s")
    return [r for r, _, _ in runs], stats


def _batches_for(fmt: Format, order: str, s: Settings) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Warm and cold batches (distinct seeds) in ``order``: random, or lmdbstore's block order."""
    n_batches = 400
    if order == "block":
        assert isinstance(fmt, LmdbstoreFormat)
        spv = fmt.spv()
        fmt.close()
        warm = block_batches(fmt.n, spv, s.batch, fmt.block_buffer, n_batches, s.seed)
        cold = block_batches(fmt.n, spv, s.batch, fmt.block_buffer, s.cold_batches, s.seed + 7)
        return warm, cold
    return random_batches(fmt.n, s.batch, n_batches, s.seed), random_batches(fmt.n, s.batch, s.cold_batches, s.seed + 7)


def add_ratios(rows: list[Row]) -> None:
    """Fill the ratio columns against memmap (fancy) and HDF5 contiguous per-sample reads."""
    mm = next((r for r in rows if r.format == "memmap"), None)
    h5 = next((r for r in rows if r.format == "h5py_contig" and r.mode == "per-sample"), None)
    for r in rows:
        if mm:
            r.read_1p_vs_memmap = ratio(r.read_1p, mm.read_1p)
            r.read_2w_vs_memmap = ratio(r.read_2w, mm.read_2w)
            r.ingest_vs_npsave = ratio(r.ingest_sps, mm.ingest_sps)
        if h5:
            r.read_1p_vs_h5py = ratio(r.read_1p, h5.read_1p)
            r.read_2w_vs_h5py = ratio(r.read_2w, h5.read_2w)


# ============================================================================ goals
@dataclass
class Goal:
    name: str
    value: float | None
    target: float
    higher_is_better: bool = True

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def line(self) -> str:
        cmp = ">=" if self.higher_is_better else "<="
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[self.met]
        val = "-" if self.value is None else f"{self.value:.2f}"
        return f"  {self.name:<58} {val:>8}  (goal {cmp} {self.target:g})  {verdict}"


def evaluate_goals(rows: list[Row]) -> list[Goal]:
    """The issue's targets, computed from baselines measured in the same run."""

    def find(fmt: str, mode: str | None = None, order: str = "random") -> Row | None:
        return next(
            (r for r in rows if r.format == fmt and (mode is None or r.mode == mode) and r.order == order), None
        )

    ls, lb = find("lmdbstore"), find("lmdbstore", order="block")
    mm, h5 = find("memmap"), find("h5py_contig", "per-sample")
    nv = find("lmdb_naive")

    def rv(a: Row | None, b: Row | None, attr: str) -> float | None:
        return ratio(getattr(a, attr), getattr(b, attr)) if a and b else None

    return [
        Goal("lmdbstore ingest / np.save sequential write", rv(ls, mm, "ingest_sps"), 0.5),
        Goal("lmdbstore bytes on disk / raw", ls.disk_vs_raw if ls else None, 1.05, higher_is_better=False),
        Goal("lmdbstore random reads / h5py per-sample (1 proc)", rv(ls, h5, "read_1p"), 10),
        Goal("lmdbstore random reads / h5py per-sample (2 workers)", rv(ls, h5, "read_2w"), 10),
        Goal("lmdbstore random reads / naive LMDB (1 proc)", rv(ls, nv, "read_1p"), 3),
        Goal("lmdbstore random reads / naive LMDB (2 workers)", rv(ls, nv, "read_2w"), 3),
        Goal("lmdbstore block order / memmap random (1 proc)", rv(lb, mm, "read_1p"), 0.8),
        Goal("lmdbstore block order / memmap random (2 workers)", rv(lb, mm, "read_2w"), 0.8),
    ]


# ============================================================================ scaling run
def scaling_probe(path: Path, kind: str, batches: int, batch: int, seed: int) -> dict[str, Any]:
    """Run in a fresh process: warm random-read samples/s and memory of one store (or memmap reference).

    ``kind`` is ``"lmdbstore"`` (a store directory, read with ``StoreReader.read_batch``) or
    ``"memmap"`` (a directory holding ``x.npy``, read by fancy indexing a ``np.load(mmap_mode="r")``).
    """
    base = rss_status()
    resident = resident_fraction(files_under(path))
    reader: StoreReader | None = None
    read: Callable[[np.ndarray], Any]
    if kind == "lmdbstore":
        reader = StoreReader(path)
        n, read = len(reader), reader.read_batch
    else:
        mm = np.load(path / "x.npy", mmap_mode="r")
        n, read = len(mm), mm.__getitem__  # fancy indexing copies the rows out of the map

    rng = np.random.default_rng([seed, 0x5CA1])  # no permutation of all n: the probe's memory stays flat
    bs = [rng.choice(n, min(batch, n), replace=False) for _ in range(batches + 1)]
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    rate = time_reads(read, bs, min_time=math.inf)  # every batch
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    n_read = (batches + 1) * batch
    mem = rss_status()
    out: dict[str, Any] = {
        "kind": kind,
        "n": n,
        "read_sps": rate,
        "samples_read": n_read,
        "resident_at_start": resident,
        "minflt_per_sample": (ru1.ru_minflt - ru0.ru_minflt) / n_read,
        "majflt_per_sample": (ru1.ru_majflt - ru0.ru_majflt) / n_read,
        # VmHWM is this process's own peak; ru_maxrss on Linux also carries the peak of the forking
        # parent across exec, so it is kept for reference only.
        "peak_rss_mib": mem.get("VmHWM"),
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_anon_mib": mem.get("RssAnon"),
        "rss_file_mib": mem.get("RssFile"),
        "rss_anon_at_start_mib": base.get("RssAnon"),
    }
    try:
        import psutil

        out["uss_mib"] = psutil.Process().memory_full_info().uss / 2**20
    except (ImportError, OSError, AttributeError):
        out["uss_mib"] = None
    if reader is not None:
        samples = reader.env_stats()["dbs"]["samples"]
        out.update({k: samples[k] for k in ("depth", "branch_pages", "leaf_pages", "overflow_pages")})
        reader.close()
    return out


def run_scaling(
    sizes: Sequence[int],
    x: np.ndarray,
    y: np.ndarray,
    root: Path,
    s: Settings,
    probe_batches: int,
    keep: bool,
    reuse: dict[int, tuple[Path, float]] | None = None,
    with_memmap: bool = True,
) -> list[dict[str, Any]]:
    """Per size: build an lmdbstore store (cycling the source data) and probe it in a fresh process;
    then the same for a plain ``.npy`` memmap of that size, the physical reference.

    ``reuse`` maps a size to an already built store of that size and its build seconds (the main
    run's lmdbstore store), which is probed instead of building the same store again.
    """
    results = []
    reuse = reuse or {}
    for size in sizes:
        if size not in reuse:
            size = _fit_to_disk(size, x[0].nbytes, root)
            if not size:
                continue
        if size in reuse:
            path, build_s = reuse[size]
        else:
            path = root / f"scaling_{size}"
            shutil.rmtree(path, ignore_errors=True)
            log(f"scaling: building lmdbstore with {size:,} samples")
            t0 = time.perf_counter()
            build_lmdbstore(path, _cycled(x, y, size), classes=[f"c{i}" for i in range(s.n_classes)])
            build_s = time.perf_counter() - t0
        res = _probe(path, "lmdbstore", s, probe_batches)
        res.update(build_s=build_s, ingest_sps=size / build_s, disk_bytes=allocated_bytes(path))
        if size not in reuse and not keep:
            shutil.rmtree(path, ignore_errors=True)
        if with_memmap:
            mpath = root / f"scaling_memmap_{size}"
            t0 = time.perf_counter()
            _build_npy(mpath, x, size)
            mm_build_s = time.perf_counter() - t0
            ref = _probe(mpath, "memmap", s, probe_batches)
            res.update({f"memmap_{k}": v for k, v in ref.items() if k not in ("kind", "n")})
            res["memmap_ingest_sps"] = size / mm_build_s
            res["read_vs_memmap"] = ratio(res["read_sps"], ref["read_sps"])
            if not keep:
                shutil.rmtree(mpath, ignore_errors=True)
        log(
            f"scaling {size:,}: lmdbstore {human(res['read_sps'])} samples/s"
            + (f" (memmap {human(res.get('memmap_read_sps'))}/s)" if with_memmap else "")
            + f", depth {res['depth']}, peak RSS {res['peak_rss_mib']:.0f} MiB (anon {res['rss_anon_mib']:.0f} MiB)"
        )
        results.append(res)
    return results


def _fit_to_disk(size: int, sample_bytes: int, root: Path) -> int:
    """``size``, or fewer samples (with a printed note) when the disk cannot hold them; 0 to skip."""
    need = int(size * sample_bytes * 1.1) + (1 << 30)
    free = shutil.disk_usage(root).free
    if need <= free:
        return size
    fit = int((free - (1 << 30)) / (sample_bytes * 1.1))
    msg = f"NOTE: scaling size {size:,} needs ~{need / 2**30:.1f} GiB, only {free / 2**30:.1f} GiB free; "
    if fit < 1000:
        print(msg + "skipped")
        return 0
    print(msg + f"using {fit:,} samples instead")
    return fit


def _build_npy(path: Path, x: np.ndarray, size: int) -> None:
    """A ``size``-sample ``x.npy`` (the source repeated), written sequentially and fsynced."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    with open(path / "x.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": np.lib.format.dtype_to_descr(x.dtype), "fortran_order": False, "shape": (size, *x.shape[1:])}
        )
        done = 0
        while done < size:
            k = min(len(x), size - done)
            for a in range(0, k, WRITE_CHUNK):
                f.write(x[a : min(a + WRITE_CHUNK, k)].tobytes())
            done += k
        f.flush()
        os.fsync(f.fileno())


def _probe(path: Path, kind: str, s: Settings, probe_batches: int) -> dict[str, Any]:
    """Warm the files' pages, then measure them in a fresh process (``--scaling-probe``)."""
    warm_s = warm_page_cache(files_under(path))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--scaling-probe", str(path), "--probe-kind", kind]
    cmd += ["--probe-batches", str(probe_batches), "--batch", str(s.batch), "--seed", str(s.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scaling probe failed for {path}: {proc.stderr.strip()[-2000:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    res["prewarm_s"] = warm_s
    return res


def _cycled(x: np.ndarray, y: np.ndarray, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The source data repeated until ``size`` samples (contents do not matter for read speed)."""
    done = 0
    while done < size:
        k = min(len(x), size - done)
        yield x[:k], y[:k]
        done += k


# ============================================================================ output
TABLE_COLS = (
    ("format / read method", 44),
    ("N", 6),
    ("ingest/s", 9),
    ("xnp.save", 8),
    ("B/sample", 8),
    ("xraw", 5),
    ("read 1p/s", 9),
    ("xmemmap", 7),
    ("xh5py", 7),
    ("read 2w/s", 9),
    ("xmemmap", 7),
    ("xh5py", 7),
    ("cold 1p/s", 9),
    ("drop", 5),
)


def _fmt_ratio(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3g}" if v < 100 else f"{v:.0f}")


def format_table(rows: list[Row], workers: int) -> str:
    """The result table as fixed-width text."""
    header = "  ".join(name.ljust(w) if i == 0 else name.rjust(w) for i, (name, w) in enumerate(TABLE_COLS))
    header = header.replace("2w", f"{workers}w")
    lines = [header, "-" * len(header)]
    for r in rows:
        drop = "-"
        if r.cold_resident_after is not None:
            drop = "ok" if r.cold_resident_after < 0.05 else f"{100 * (1 - r.cold_resident_after):.0f}%"
        cells = [
            r.label,
            human(r.n),
            human(r.ingest_sps),
            _fmt_ratio(r.ingest_vs_npsave),
            f"{r.disk_per_sample:.0f}" if r.disk_per_sample else "-",
            f"{r.disk_vs_raw:.2f}" if r.disk_vs_raw else "-",
            human(r.read_1p),
            _fmt_ratio(r.read_1p_vs_memmap),
            _fmt_ratio(r.read_1p_vs_h5py),
            human(r.read_2w),
            _fmt_ratio(r.read_2w_vs_memmap),
            _fmt_ratio(r.read_2w_vs_h5py),
            human(r.cold_1p),
            drop,
        ]
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, (_, w)) in enumerate(zip(cells, TABLE_COLS, strict=True))
            )
        )
    return "\n".join(lines)


def format_scaling(results: list[dict[str, Any]]) -> str:
    """The scaling table as fixed-width text."""
    head = (
        f"{'samples':>10} {'ingest/s':>9} {'B/sample':>8} {'depth':>5} {'branch':>6} {'leaf':>6} "
        f"{'read/s':>8} {'memmap/s':>8} {'xmemmap':>7} {'peak RSS':>8} {'anon':>6} {'file':>6} "
        f"{'majflt':>8} {'resident':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        res = r.get("resident_at_start")
        lines.append(
            f"{r['n']:>10,} {human(r['ingest_sps']):>9} {r['disk_bytes'] / r['n']:>8.0f} {r['depth']:>5} "
            f"{r['branch_pages']:>6} {r['leaf_pages']:>6} {human(r['read_sps']):>8} "
            f"{human(r.get('memmap_read_sps')):>8} {_fmt_ratio(r.get('read_vs_memmap')):>7} "
            f"{r['peak_rss_mib'] or 0:>8.0f} {r['rss_anon_mib'] or 0:>6.0f} {r['rss_file_mib'] or 0:>6.0f} "
            f"{r['majflt_per_sample']:>8.3f} {'-' if res is None else f'{100 * res:.0f}%':>8}"
        )
    return "\n".join(lines)


def write_csv(path: Path, records: list[dict[str, Any]]) -> None:
    if not records:
        path.write_text("")
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records)


def row_record(r: Row) -> dict[str, Any]:
    d = asdict(r)
    d = {"label": r.label, **d}
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def plot(rows: list[Row], path: Path, workers: int, batch: int, subtitle: str) -> Path | None:
    """Horizontal bars of read samples/s per format/method: 1 process, workers, cold (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("NOTE: matplotlib not installed; no plot")
        return None
    labels = [r.label + ("" if r.n == rows[0].n else f" [N={human(r.n)}]") for r in rows]
    series = [
        ("1 process, warm", [r.read_1p for r in rows]),
        (f"DataLoader {workers} workers, warm", [r.read_2w for r in rows]),
        ("1 process, cold cache", [r.cold_1p for r in rows]),
    ]
    series = [(name, vals) for name, vals in series if any(v for v in vals)]
    ypos = np.arange(len(rows))
    height = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.5))
    for k, (name, vals) in enumerate(series):
        ax.barh(ypos + (k - (len(series) - 1) / 2) * height, [v or 0 for v in vals], height, label=name)
    ax.set_yticks(ypos, labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"random-batch read throughput (samples/s, batch {batch}, log scale)")
    ax.set_title(f"Read throughput by format: {subtitle}", fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ============================================================================ main
def parse_sizes(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    return [int(float(t)) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=None, help="samples per format (default 1,000,000; --quick 20,000)")
    p.add_argument("--npy-n", type=int, default=None, help="samples for per-sample .npy files (default 50,000)")
    p.add_argument("--shape", default="25,25", help="sample shape (float32), default 25,25")
    p.add_argument("--classes", type=int, default=5, help="number of classes (default 5)")
    p.add_argument("--batch", type=int, default=4096, help="batch size (default 4096)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2; 0 skips)")
    p.add_argument("--formats", default=",".join(FORMAT_ORDER), help="comma-separated formats (default all)")
    p.add_argument("--scaling-sizes", default=None, help="store sizes for the scaling run, or 'none'")
    p.add_argument("--probe-batches", type=int, default=None, help="random batches read per scaling probe")
    p.add_argument("--min-time", type=float, default=None, help="seconds per warm measurement (default 1.5)")
    p.add_argument("--cold-batches", type=int, default=None, help="batches per cold-cache measurement (default 2)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache measurement")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--out", default="bench_out", help="output directory (CSV, JSON, PNG)")
    p.add_argument("--data-dir", default=None, help="where the data files go (default OUT/data)")
    p.add_argument("--keep", action="store_true", help="keep the data files")
    p.add_argument("--quick", action="store_true", help="tiny sizes and short timings (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-scaling-memmap", action="store_true", help="skip the memmap reference in the scaling run")
    p.add_argument("--scaling-probe", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-kind", default="lmdbstore", choices=("lmdbstore", "memmap"), help=argparse.SUPPRESS)
    return p


def resolve(args: argparse.Namespace) -> tuple[Settings, list[str], list[int], int]:
    """Settings from the arguments (``--quick`` changes the defaults); ValueError names a bad one."""
    q = args.quick
    n = args.n if args.n is not None else (20_000 if q else 1_000_000)
    npy_n = args.npy_n if args.npy_n is not None else min(n, 5_000 if q else 50_000)
    shape = tuple(int(t) for t in args.shape.split(","))
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"--formats: unknown format {f!r}; choose from {', '.join(FORMATS)}")
    formats = [f for f in FORMAT_ORDER if f in formats]
    if args.scaling_sizes is not None:
        sizes = parse_sizes(args.scaling_sizes)
    else:
        sizes = [max(1000, n // 4), n] if q else list(DEFAULT_SCALING)
    if n < 1 or npy_n < 1:
        raise ValueError("--n and --npy-n must be positive")
    if args.batch < 1:
        raise ValueError("--batch must be positive")
    s = Settings(
        n=n,
        npy_n=min(npy_n, n),
        shape=shape,
        n_classes=args.classes,
        batch=args.batch,
        workers=args.workers,
        min_time=args.min_time if args.min_time is not None else (0.2 if q else 1.5),
        cold_batches=args.cold_batches if args.cold_batches is not None else (1 if q else 2),
        cold_max_time=2.0 if q else 5.0,
        seed=args.seed,
        cold=not args.no_cold,
    )
    probe = args.probe_batches if args.probe_batches is not None else (3 if q else 60)
    return s, formats, sizes, probe


def dataset_line(s: Settings) -> str:
    return f"{s.n:,} samples of {'x'.join(map(str, s.shape))} float32, {s.n_classes} classes, batch {s.batch}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns everything that was written to the JSON file."""
    args = build_parser().parse_args(argv)
    if args.scaling_probe:
        probe = scaling_probe(
            Path(args.scaling_probe), args.probe_kind, args.probe_batches or 60, args.batch, args.seed
        )
        print(json.dumps(probe))
        return {}
    s, formats, sizes, probe_batches = resolve(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir) if args.data_dir else out / "data"
    data.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    info = machine_info(data)
    print(describe_machine(info))
    print(f"Dataset: {dataset_line(s)}; per-sample .npy files at {s.npy_n:,} samples\n", flush=True)
    log("generating data")
    x, y = make_data(s.n, s.shape, s.n_classes, s.seed)
    rows: list[Row] = []
    builds: dict[str, Any] = {}
    fmts: list[Format] = []
    reuse: dict[int, tuple[Path, float]] = {}
    try:
        for name in formats:
            fmt = make_format(name, data)
            fmts.append(fmt)
            n_f = s.npy_n if name == "npy_files" else s.n
            need = int(n_f * x[0].nbytes * 2.0) + (1 << 30)
            if shutil.disk_usage(data).free < need:
                print(f"NOTE: skipped {name}: needs ~{need / 2**30:.1f} GiB free")
                continue
            f_rows, stats = measure_format(fmt, x[:n_f], y[:n_f], s)
            if name == "npy_files" and n_f < s.n:
                for r in f_rows:
                    r.note += f"; at {n_f:,} samples (one file per sample is too slow to build at {s.n:,})"
            rows.extend(f_rows)
            builds[name] = asdict(stats)
            if name == "lmdbstore":
                builds[name]["env_stats"] = _jsonable(fmt.env_stats())  # type: ignore[attr-defined]
            if name == "lmdbstore" and s.n in sizes:
                reuse[s.n] = (fmt.dir, stats.seconds)  # the scaling run probes it instead of rebuilding
            elif not args.keep and name != "npy_files":  # its many files are deleted last, in the background
                fmt.remove()
        add_ratios(rows)
        scaling = (
            run_scaling(sizes, x, y, data, s, probe_batches, args.keep, reuse, not args.no_scaling_memmap)
            if sizes
            else []
        )
    finally:
        if not args.keep:
            for fmt in fmts:
                fmt.remove()
    goals = evaluate_goals(rows)
    elapsed = time.perf_counter() - t_start
    report = render_report(rows, scaling, goals, s, elapsed)
    print(report)
    csv_path, scaling_csv = out / "bench_results.csv", out / "bench_scaling.csv"
    write_csv(csv_path, [row_record(r) for r in rows])
    write_csv(scaling_csv, scaling)
    png = (
        None
        if args.no_plot or not rows
        else plot(rows, out / "bench_read_throughput.png", s.workers, s.batch, dataset_line(s))
    )
    result = {
        "machine": info,
        "settings": asdict(s),
        "rows": [row_record(r) for r in rows],
        "builds": builds,
        "scaling": scaling,
        "goals": [{**asdict(g), "met": g.met} for g in goals],
        "elapsed_s": elapsed,
        "csv": str(csv_path),
        "png": str(png) if png else None,
    }
    (out / "bench_results.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"\nWrote {csv_path}, {scaling_csv}, {out / 'bench_results.json'}" + (f", {png}" if png else ""))
    if not args.keep:
        with contextlib.suppress(OSError):
            data.rmdir()  # only if empty
    return result


def render_report(
    rows: list[Row], scaling: list[dict[str, Any]], goals: list[Goal], s: Settings, elapsed: float
) -> str:
    """Table, notes, goals and scaling table as printed."""
    parts = [format_table(rows, s.workers), ""]
    parts.append(
        "Columns: ingest/s includes the final fsync; B/sample = allocated disk blocks / samples (raw = "
        f"{int(np.prod(s.shape)) * 4} B); read = random batches of {s.batch} (x and labels), warm page cache, median rate over batches "
        "(robust to other processes on a shared machine); "
        f"{s.workers}w = DataLoader with {s.workers} workers (batch_size=None, one __getitem__ per batch); "
        "xmemmap / xh5py = ratio to numpy memmap / HDF5 contiguous per-sample reads in this run; cold = "
        "after posix_fadvise(DONTNEED) on every file of the format, drop = share of pages evicted "
        "('ok' = all)."
    )
    for r in rows:
        if r.cold_resident_after is not None and r.cold_resident_after > 0.05:
            parts.append(
                f"NOTE: dropping the page cache had little effect for {r.label}: "
                f"{100 * r.cold_resident_after:.0f}% still resident"
            )
    notes = {r.format: r.note for r in rows}
    parts += ["", "Formats:"] + [f"  {k:<13} {v}" for k, v in notes.items()]
    parts += ["", "Goals (ratios within this run):"] + [g.line() for g in goals]
    if scaling:
        parts += ["", "Scaling (lmdbstore, warm random reads in a fresh reader process):", format_scaling(scaling)]
        parts.append(
            "read/s = warm random batches through StoreReader.read_batch in a fresh process, after the store "
            "was read into the page cache; memmap/s = the same batches from a plain .npy memmap of the same "
            "size (physical reference); depth/branch/leaf = B-tree of the samples sub-database; peak RSS = "
            "VmHWM of the reader (MiB; it counts page-cache pages the reads mapped; ru_maxrss, in the JSON, "
            "inherits the forking parent's peak on Linux); anon = RssAnon (the process's own memory); file = "
            "RssFile (shared, reclaimable page-cache pages mapped); majflt = major page faults per sample "
            "read (disk reads: >0 means the store did not stay in the page cache); resident = share of the "
            "files in the page cache when the probe started. Every probe reads the same number of batches."
        )
    parts.append(f"\nTotal time: {elapsed:.0f}s")
    return "\n".join(parts)


def _jsonable(d: Any) -> Any:
    if isinstance(d, dict):
        return {str(k): _jsonable(v) for k, v in d.items()}
    return d


if __name__ == "__main__":
    main()
