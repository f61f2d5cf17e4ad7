"""lmdbstore side by side with the loaders people pick today: MosaicML streaming (MDS), Lightning
litdata and webdataset, on the same data (default 1M z-scored 25x25 float32 samples, 5 classes).

For each library, with its own recommended writer and reader:

* ingest samples/s (write everything, then flush to disk),
* bytes on disk per sample, against the raw 2,500 bytes,
* warm random batches in one process through the library's own random-access API (batches of 4,096
  distinct random indices, page cache warm),
* a shuffled epoch through the library's recommended loader, 2 workers, batch 4,096,
* cold random reads: the same random-access API right after the files' pages were dropped from the
  page cache (``posix_fadvise(DONTNEED)``; handles closed first, so mapped pages go too).

Ratios are lmdbstore's rate over each peer's, measured in the same run (a numpy memmap row is the
raw-copy baseline).  The peers are an optional extra (``pip install 'lmdbstore[peers]'``); a library
that is missing or fails keeps its row with the reason.  Not part of the tests or CI.

    python scripts/bench_peers.py [-n 1000000] [--dir /tmp/bench_peers] [--min-time 15] [--out DIR]

Notes on fairness: MDS and litdata shuffle shards/chunks and then samples within a window (their
design for streaming from object stores), not a full permutation; lmdbstore's loader draws a fresh
full permutation each epoch.  webdataset has no random access (``n/a``): its loader streams shuffled
shards through a 5,000-sample shuffle buffer.  Warm rates are medians over batches.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # shared helpers: data, timing, page-cache control (imported after the path is set)

RAW_SHAPE = (25, 25)
N_CLASSES = 5
BATCH = 4096
WORKERS = 2
COLD_BATCH = 256
PEERS = ("memmap", "lmdbstore", "mds", "litdata", "webdataset")
DISTS = {"mds": "mosaicml-streaming", "litdata": "litdata", "webdataset": "webdataset", "lmdbstore": "lmdbstore",
         "memmap": "numpy"}  # fmt: skip


def version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


@dataclass
class Result:
    name: str
    version: str
    ingest_sps: float | None = None
    bytes_per_sample: float | None = None
    warm_random_sps: float | None = None
    epoch_sps: float | None = None
    cold_random_sps: float | None = None
    cold_resident_after_drop: float | None = None
    note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- peers
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
        return bench.files_under(self.dir)


class BenchFormatPeer(Peer):
    """lmdbstore and memmap through scripts/bench.py's adapters (the same code as the format benchmark)."""

    fmt_cls: Any = None

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
        batches = bench.random_batches(self.n, batch, max(4, self.n // batch), seed=5)
        return self.fmt.loader(batches, self.mode, "random", workers)


class LmdbstorePeer(BenchFormatPeer):
    name, fmt_cls = "lmdbstore", bench.LmdbstoreFormat
    note = "open_writer; StoreReader.read_batch; LmdbBatchDataset + EpochBatchSampler (random)"


class MemmapPeer(BenchFormatPeer):
    name, fmt_cls = "memmap", bench.MemmapFormat
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


# ---------------------------------------------------------------------------------------------- measuring
def _cold(peer: Peer, batches: Sequence[np.ndarray], max_time: float) -> tuple[float, float | None]:
    peer.close()
    paths = peer.files()
    bench.drop_page_cache(paths)
    after = bench.resident_fraction(paths)
    peer.open()
    done, t0 = 0, time.perf_counter()
    for b in batches:
        peer.read(b)
        done += len(b)
        if time.perf_counter() - t0 >= max_time:
            break
    return done / (time.perf_counter() - t0), after


def measure(peer: Peer, x: np.ndarray, y: np.ndarray, args: argparse.Namespace, log: Callable[[str], None]) -> Result:
    res = Result(peer.name, version(DISTS[peer.name]), note=peer.note)
    try:
        peer.prepare()
        log(f"{peer.name}: writing {len(x):,} samples")
        t0 = time.perf_counter()
        peer.build(x, y)
        bench.flush_to_disk(peer.dir)
        secs = getattr(peer, "build_seconds_without_source", None) or (time.perf_counter() - t0)
        res.ingest_sps = len(x) / secs
        res.bytes_per_sample = bench.allocated_bytes(peer.dir) / len(x)
        if peer.random_access:
            batches = bench.random_batches(len(x), BATCH, 64, seed=11)
            bench.warm_page_cache(peer.files())
            peer.open()
            sample = batches[0][:16]
            gx, gy = peer.read(sample)
            if not (np.array_equal(gx.view(np.uint32), x[sample].view(np.uint32)) and np.array_equal(gy, y[sample])):
                raise RuntimeError("random reads returned the wrong samples")
            log(f"{peer.name}: warm random batches")
            res.warm_random_sps = bench.time_reads(peer.read, batches, args.min_time)
            log(f"{peer.name}: cold random reads")
            cold = bench.random_batches(len(x), COLD_BATCH, 400, seed=12)
            res.cold_random_sps, res.cold_resident_after_drop = _cold(peer, cold, args.cold_time)
            peer.close()
        bench.warm_page_cache(peer.files())
        log(f"{peer.name}: shuffled epoch, {WORKERS} workers, batch {BATCH}")
        res.epoch_sps = bench.time_loader(peer.loader(BATCH, WORKERS), WORKERS, args.min_time)
    except Exception as exc:  # keep the row, with the reason
        res.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        log(f"{peer.name}: FAILED {res.error}")
    finally:
        peer.close()
    if peer.name == "mds" and "streaming" in sys.modules:
        note = getattr(sys.modules["streaming"], "_lmdbstore_note", None)
        if note:
            res.extra["import"] = note
    return res


def _r(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None or b <= 0 else f" ({a / b:.1f}x)"


def _v(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def format_table(results: list[Result], n: int) -> str:
    """Markdown table; ``(Nx)`` after a peer's rate is lmdbstore's rate divided by it."""
    ref = next((r for r in results if r.name == "lmdbstore"), None)
    raw = int(np.prod(RAW_SHAPE)) * 4
    lines = [
        f"| library | version | ingest samples/s | bytes/sample (x raw) | warm random batches, 1 process, samples/s "
        f"(lmdbstore / it) | shuffled epoch, {WORKERS} workers, batch {BATCH}, samples/s (lmdbstore / it) "
        "| cold random samples/s (lmdbstore / it) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error and r.ingest_sps is None:
            lines.append(f"| {r.name} | {r.version} | failed: {r.error} | | | | |")
            continue
        cells = [
            r.name,
            r.version,
            _v(r.ingest_sps),
            "n/a" if r.bytes_per_sample is None else f"{r.bytes_per_sample:,.0f} ({r.bytes_per_sample / raw:.2f}x)",
        ]
        for key in ("warm_random_sps", "epoch_sps", "cold_random_sps"):
            v = getattr(r, key)
            other = getattr(ref, key) if ref is not None and r.name != "lmdbstore" else None
            cells.append(_v(v) + _r(other, v))
        if r.error:
            cells[-1] += f" (failed later: {r.error})"
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{n:,} samples of {RAW_SHAPE[0]}x{RAW_SHAPE[1]} float32 ({raw:,} B raw), {N_CLASSES} classes.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-n", "--samples", type=int, default=1_000_000)
    p.add_argument("--dir", type=Path, default=Path("/tmp/lmdbstore_bench_peers"), help="scratch directory")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--min-time", type=float, default=15.0, help="seconds per timed read / loader measurement")
    p.add_argument("--cold-time", type=float, default=10.0, help="seconds of cold random reads")
    p.add_argument("--out", type=Path, default=None, help="write peers.md and peers.json here")
    p.add_argument("--keep", action="store_true", help="keep the written data")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = [s for s in names if s not in PEER_CLASSES]
    if unknown or args.samples < BATCH:
        p.error(f"unknown peers {unknown}" if unknown else f"--samples must be at least {BATCH}")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    args.dir.mkdir(parents=True, exist_ok=True)
    x, y = bench.make_data(args.samples, RAW_SHAPE, N_CLASSES, seed=0)
    results = []
    for name in names:
        peer = PEER_CLASSES[name](args.dir, args.samples)
        results.append(measure(peer, x, y, args, log))
        if not args.keep:
            shutil.rmtree(peer.dir, ignore_errors=True)
    table = format_table(results, args.samples)
    machine = bench.describe_machine(bench.machine_info(args.dir))
    print(table)
    print(f"\nmachine: {machine}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "peers.md").write_text(table + f"\n\nmachine: {machine}\n")
        (args.out / "peers.json").write_text(
            json.dumps({"samples": args.samples, "machine": machine, "results": [asdict(r) for r in results]}, indent=2)
        )
    return results


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
