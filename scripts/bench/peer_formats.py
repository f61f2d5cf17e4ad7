"""The libraries the peers benchmark compares, each behind one adapter (:class:`Peer`): build from ``(x, y)``
with the library's own recommended writer, random-access reads, the recommended shuffled loader, and the
files (for page-cache control).  ``memmap`` and ``lmdbstore`` reuse ``bench.formats``' adapters.

The peer libraries are an optional extra (``pip install 'lmdbstore[peers]'``), imported only when used.
Not a benchmark itself: ``bench.peers`` (run as ``python scripts/bench/peers.py``) measures these.
"""

from __future__ import annotations

import shutil
import sys
import time
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import random_batches
from bench.formats import Format, LmdbstoreFormat, MemmapFormat
from bench.machine import files_under

RAW_SHAPE = (25, 25)


class Peer:
    """Build from (x, y); random-access reads; the recommended shuffled loader; files for cache control."""

    name = ""
    random_access = True
    note = ""

    def __init__(self, root: Path, n: int):
        self.dir = root / self.name
        self.n = n

    def prepare(self) -> None:
        """Import the library (outside the timed build: some import for seconds)."""

    def build(self, x: np.ndarray, y: np.ndarray) -> None:
        raise NotImplementedError

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def loader(self, batch: int, workers: int) -> Iterable[Any]:
        raise NotImplementedError

    def files(self) -> list[Path]:
        return files_under(self.dir)


class BenchFormatPeer(Peer):
    """lmdbstore and memmap through ``bench.formats``' adapters (the same code as the storage benchmark)."""

    fmt_cls: type[Format] = Format

    def __init__(self, root: Path, n: int):
        super().__init__(root, n)
        self.fmt = self.fmt_cls(root)
        self.dir = self.fmt.dir
        self.mode = self.fmt.modes[0]

    def build(self, x: np.ndarray, y: np.ndarray) -> None:
        self.fmt.build(x, y)

    def open(self) -> None:
        self.fmt.open()

    def close(self) -> None:
        self.fmt.close()

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.fmt.read_xy(idx, self.mode)

    def loader(self, batch: int, workers: int) -> Iterable[Any]:
        batches = random_batches(self.n, batch, max(4, self.n // batch), seed=5)
        return self.fmt.loader(batches, self.mode, "random", workers)


class LmdbstorePeer(BenchFormatPeer):
    name, fmt_cls = "lmdbstore", LmdbstoreFormat
    note = "open_writer; StoreReader.read_batch; LmdbBatchDataset + EpochBatchSampler (random)"


class MemmapPeer(BenchFormatPeer):
    name, fmt_cls = "memmap", MemmapFormat
    note = "baseline: np.save + np.load(mmap_mode='r') fancy indexing; loader = batch-indexed Dataset"


def _import_streaming() -> Any:
    """Import MosaicML streaming.  It imports torchvision at the top (for its vision datasets only); the
    torchvision wheel the index resolves for torch 2.13 is a CUDA build that cannot load beside a CPU
    torch, so when it fails a stand-in with the two names streaming.vision imports is used."""
    try:
        import streaming

        return streaming
    except Exception as exc:  # torchvision's C++ ops fail to load
        for mod in [m for m in sys.modules if m.startswith(("torchvision", "streaming"))]:
            del sys.modules[mod]
        tv = types.ModuleType("torchvision")
        tv_ds = types.ModuleType("torchvision.datasets")
        tv_tf = types.ModuleType("torchvision.transforms")
        tv_fn = types.ModuleType("torchvision.transforms.functional")
        tv_ds.VisionDataset = object  # type: ignore[attr-defined]
        tv_ds.CIFAR10 = object  # type: ignore[attr-defined]
        tv_fn.to_tensor = lambda x: x  # type: ignore[attr-defined]
        tv.datasets, tv.transforms, tv_tf.functional = tv_ds, tv_tf, tv_fn  # type: ignore[attr-defined]
        sys.modules.update({"torchvision": tv, "torchvision.datasets": tv_ds, "torchvision.transforms": tv_tf,
                            "torchvision.transforms.functional": tv_fn})  # fmt: skip
        import streaming

        streaming._lmdbstore_note = f"torchvision stand-in ({type(exc).__name__})"  # type: ignore[attr-defined]
        return streaming


class MdsPeer(Peer):
    name = "mds"
    note = "MDSWriter (ndarray:float32:25,25 + int, no compression); StreamingDataset.get_item; StreamingDataLoader"

    def prepare(self) -> None:
        _import_streaming()

    def build(self, x: np.ndarray, y: np.ndarray) -> None:
        MDSWriter = _import_streaming().MDSWriter
        columns = {"x": f"ndarray:float32:{','.join(map(str, RAW_SHAPE))}", "y": "int"}
        with MDSWriter(out=str(self.dir), columns=columns, compression=None, size_limit=1 << 26) as w:
            for i in range(len(x)):
                w.write({"x": x[i], "y": int(y[i])})

    def _dataset(self, shuffle: bool, batch: int | None = None) -> Any:
        streaming = _import_streaming()
        streaming.base.util.clean_stale_shared_memory()
        return streaming.StreamingDataset(local=str(self.dir), shuffle=shuffle, batch_size=batch, shuffle_seed=1)

    def open(self) -> None:
        self.ds = self._dataset(False)

    def close(self) -> None:
        self.ds = None

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        items = [self.ds.get_item(int(i)) for i in idx]
        return np.stack([it["x"] for it in items]), np.array([it["y"] for it in items])

    def loader(self, batch: int, workers: int) -> Iterable[Any]:
        streaming = _import_streaming()
        ds = self._dataset(True, batch)
        return _Pairs(
            streaming.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=False)
        )


def _litdata_samples(arg: tuple[str, int, int]) -> Any:
    """litdata optimize fn: yield the samples of one range of the memmapped arrays (runs in its workers)."""
    path, lo, hi = arg
    x = np.load(Path(path) / "x.npy", mmap_mode="r")
    y = np.load(Path(path) / "y.npy", mmap_mode="r")
    for i in range(lo, hi):
        yield {"x": np.array(x[i]), "y": int(y[i])}


class LitdataPeer(Peer):
    name = "litdata"
    note = "optimize (1 worker, 64 MB chunks); StreamingDataset[i] (batch_decode=0: per item); StreamingDataLoader"

    def prepare(self) -> None:
        import litdata  # noqa: F401

    def build(self, x: np.ndarray, y: np.ndarray) -> None:
        import litdata

        src = self.dir.parent / "litdata_src"
        src.mkdir(parents=True, exist_ok=True)
        np.save(src / "x.npy", x)
        np.save(src / "y.npy", y)
        step = 50_000
        inputs = [(str(src), lo, min(lo + step, len(x))) for lo in range(0, len(x), step)]
        t0 = time.perf_counter()
        litdata.optimize(fn=_litdata_samples, inputs=inputs, output_dir=str(self.dir), chunk_bytes="64MB",
                         num_workers=1, mode="overwrite", start_method="fork")  # fmt: skip
        self.build_seconds_without_source = time.perf_counter() - t0
        shutil.rmtree(src)

    def _dataset(self, shuffle: bool) -> Any:
        import litdata

        # random access decodes one item per read (batch_decode=0); the loader keeps the default windowed decode
        return litdata.StreamingDataset(input_dir=str(self.dir), shuffle=shuffle, seed=1,
                                        batch_decode="auto" if shuffle else 0)  # fmt: skip

    def open(self) -> None:
        self.ds = self._dataset(False)

    def close(self) -> None:
        self.ds = None

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        items = [self.ds[int(i)] for i in idx]
        return np.stack([np.asarray(it["x"]) for it in items]), np.array([int(it["y"]) for it in items])

    def loader(self, batch: int, workers: int) -> Iterable[Any]:
        import litdata

        return _Pairs(litdata.StreamingDataLoader(self._dataset(True), batch_size=batch, num_workers=workers))


class WebdatasetPeer(Peer):
    name = "webdataset"
    random_access = False
    note = "ShardWriter (.npy + cls, 100k samples/shard); WebDataset shardshuffle + shuffle(5000) + batched; WebLoader"

    def prepare(self) -> None:
        import webdataset  # noqa: F401

    def build(self, x: np.ndarray, y: np.ndarray) -> None:
        import webdataset as wds

        self.dir.mkdir(parents=True, exist_ok=True)
        with wds.ShardWriter(str(self.dir / "shard-%06d.tar"), maxcount=100_000, verbose=0) as w:
            for i in range(len(x)):
                w.write({"__key__": f"{i:09d}", "x.npy": x[i], "cls": int(y[i])})

    def loader(self, batch: int, workers: int) -> Iterable[Any]:
        import webdataset as wds

        urls = [str(p) for p in sorted(self.dir.glob("shard-*.tar"))]
        ds = (
            wds.WebDataset(urls, shardshuffle=len(urls), seed=1, empty_check=False)
            .shuffle(5000)
            .decode()
            .to_tuple("x.npy", "cls")
            .batched(batch, partial=True)
        )
        return wds.WebLoader(ds, batch_size=None, num_workers=workers)


class _Pairs:
    """A loader of ``{"x": ..., "y": ...}`` batches seen as ``(x, y)`` pairs (what the timing expects)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader

    def __iter__(self) -> Any:
        for b in self.loader:
            yield b["x"], b["y"]


PEER_CLASSES: dict[str, type[Peer]] = {
    "memmap": MemmapPeer,
    "lmdbstore": LmdbstorePeer,
    "mds": MdsPeer,
    "litdata": LitdataPeer,
    "webdataset": WebdatasetPeer,
}
