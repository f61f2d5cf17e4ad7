"""Storage formats behind one adapter (:class:`Format`: build from ``(x, y)``, read batches of ``(x, y)`` by
index, a DataLoader over it), and the two formats every comparison runs:

* ``memmap``       one ``.npy`` file written by ``np.save`` and read through ``np.load(mmap_mode="r")``:
                   the raw sequential write rate and the physical in-cache read baseline.
* ``lmdbstore``    this library (``open_writer`` / ``StoreReader.read_batch``), random and block order.

Not a benchmark itself: ``bench.storage`` measures these and the formats of ``bench.other_formats``;
``bench.peers`` uses these two as its baseline rows.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import build_store
from bench.machine import allocated_bytes, files_under, flush_to_disk
from lmdbstore.store.reader import StoreReader


@dataclass
class BuildStats:
    """What building a format cost: samples, seconds (final flush included), allocated disk bytes."""

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
        """Write ``(x, y)`` into the empty directory ``self.dir`` (the flush to disk follows)."""
        raise NotImplementedError

    def _open(self) -> Any:
        """Open the handles ``read_xy`` uses (called in the process that reads)."""
        raise NotImplementedError

    def _close(self, h: Any) -> None:
        """Close the handles ``_open`` returned."""

    def read_xy(self, idx: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
        """Samples and labels at ``idx`` (in that order) using read method ``mode``."""
        raise NotImplementedError

    def used_bytes(self) -> int | None:
        """Bytes of pages in use, for formats that allocate pages ahead (LMDB); ``None`` for the others."""
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
        """Every file of the format (whose pages a cold read drops)."""
        return files_under(self.dir)

    def handles(self) -> Any:
        """This process's handles, opened on first use and again after a fork."""
        if self._h is None or self._pid != os.getpid():
            self._h = self._open()  # an inherited handle belongs to the parent: drop it unclosed
            self._pid = os.getpid()
        return self._h

    def open(self) -> None:
        """Open the handles now (outside a timing)."""
        self.handles()

    def close(self) -> None:
        """Close this process's handles (an inherited one is only forgotten)."""
        if self._h is not None and self._pid == os.getpid():
            self._close(self._h)
        self._h = None

    def remove(self) -> None:
        """Close and delete the format's files."""
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
        build_store(self.dir, [(x, y)], classes=[f"c{i}" for i in range(int(y.max(initial=0)) + 1)])

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
        from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
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
