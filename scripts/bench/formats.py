"""The other ways to store many small samples, and the loaders people pick today, each built from the benchmarks'
samples (:func:`.data.chunks`) and read the way its library recommends:

* ``h5``, ``h5chunked``: HDF5 contiguous / in chunks of 16 samples (h5py); ``dset[i]`` per sample or one sorted
  fancy-index read per batch;
* ``sqlite``: one BLOB per row, one ``WHERE id IN (...)`` query per batch;
* ``lmdb1``: one LMDB key per sample (the sample's bytes), one ``txn.get`` per sample: how tutorials do it;
* ``npyfiles``: one ``.npy`` file per sample (the first :data:`.measures.NPY_FILES` samples);
* ``mds``, ``litdata``, ``wds``: MosaicML streaming, Lightning litdata and webdataset with their own writers; random
  access through their datasets, shuffled epochs through their loaders (the ``[peers]`` extra).

:data:`BUILDERS` builds them, :func:`format_read` and :func:`peer_epoch` are the measurements.
"""

from __future__ import annotations

import sqlite3
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .data import CHUNK, chunks
from .measures import NPY_FILES, WARM_BATCHES, first_then_rate, timed, warm_batches
from .spec import Ctx, Data, Measure


# ============================================================================ building
def write_h5(path: Path, data: Data, chunked: bool = False) -> None:
    import h5py

    path.mkdir()
    with h5py.File(path / "data.h5", "w") as f:
        cs = (16, *data.shape) if chunked else None
        dx = f.create_dataset("x", shape=(data.samples, *data.shape), dtype=data.dtype, chunks=cs)
        for a, x, _y in chunks(data):
            dx[a : a + len(x)] = x


def write_sqlite(path: Path, data: Data) -> None:
    path.mkdir()
    con = sqlite3.connect(path / "data.db")
    try:
        con.execute("CREATE TABLE samples (id INTEGER PRIMARY KEY, label INTEGER NOT NULL, x BLOB NOT NULL)")
        for a, x, y in chunks(data):
            with con:
                con.executemany(
                    "INSERT INTO samples VALUES (?, ?, ?)", ((a + i, int(y[i]), x[i].tobytes()) for i in range(len(x)))
                )
    finally:
        con.close()


def write_lmdb1(path: Path, data: Data) -> None:
    import lmdb

    env = lmdb.open(str(path), map_size=max(1 << 26, data.samples * (data.sample_bytes + 2048) * 2))
    try:
        for a, x, _y in chunks(data):
            with env.begin(write=True) as txn:
                for i in range(len(x)):
                    txn.put(b"%08d" % (a + i), x[i].tobytes())
    finally:
        env.close()


def write_npyfiles(path: Path, data: Data) -> None:
    path.mkdir()
    for a, x, _y in chunks(data, 0, min(data.samples, NPY_FILES)):
        for i in range(len(x)):
            np.save(path / f"{a + i:08d}.npy", x[i])


def write_mds(path: Path, data: Data) -> None:
    streaming = import_streaming()
    columns = {"x": f"ndarray:{data.dtype}:{','.join(map(str, data.shape))}", "y": "int"}
    with streaming.MDSWriter(out=str(path), columns=columns, compression=None, size_limit=1 << 26) as w:
        for _a, x, y in chunks(data):
            for i in range(len(x)):
                w.write({"x": x[i], "y": int(y[i])})


def _litdata_samples(task: tuple[int, int, str, tuple[int, ...]]) -> Any:
    """litdata's ``optimize`` function: the samples of one task (runs in its workers)."""
    from .data import produce

    x, y = produce(task)
    for i in range(len(x)):
        yield {"x": x[i], "y": int(y[i])}


def write_litdata(path: Path, data: Data) -> None:
    import litdata

    tasks = [(a, min(a + CHUNK, data.samples), data.dtype, data.shape) for a in range(0, data.samples, CHUNK)]
    litdata.optimize(
        fn=_litdata_samples,
        inputs=tasks,
        output_dir=str(path),
        chunk_bytes="64MB",
        num_workers=1,
        mode="overwrite",
        start_method="fork",
    )


def write_wds(path: Path, data: Data) -> None:
    import webdataset as wds

    path.mkdir()
    with wds.ShardWriter(str(path / "shard-%06d.tar"), maxcount=100_000, verbose=0) as w:
        for a, x, y in chunks(data):
            for i in range(len(x)):
                w.write({"__key__": f"{a + i:09d}", "x.npy": x[i], "cls": int(y[i])})


def _raw(factor: float) -> Callable[[Data], int]:
    return lambda d: int(factor * d.samples * d.sample_bytes) + (64 << 20)


BUILDERS: dict[str, tuple[Callable[[Path, Data], None], Callable[[Data], int]]] = {
    "h5": (write_h5, _raw(1.0)),
    "h5chunked": (lambda p, d: write_h5(p, d, chunked=True), _raw(1.0)),
    "sqlite": (write_sqlite, _raw(1.2)),
    "lmdb1": (write_lmdb1, _raw(2.0)),
    "npyfiles": (write_npyfiles, lambda d: min(d.samples, NPY_FILES) * (d.sample_bytes + 4096)),
    "mds": (write_mds, _raw(1.1)),
    "litdata": (write_litdata, _raw(1.1)),
    "wds": (write_wds, _raw(1.3)),
}


# ============================================================================ reading
def opener(kind: str, mode: str, path: Path, data: Data) -> tuple[Callable[[np.ndarray], np.ndarray], Any]:
    """``read(idx) -> samples`` of format ``kind`` read by ``mode``, and what to close."""
    if kind in ("h5", "h5chunked"):
        import h5py

        f = h5py.File(path / "data.h5", "r")
        dx = f["x"]
        if mode == "per sample":
            return lambda idx: np.stack([dx[i] for i in idx.tolist()]), f
        return lambda idx: dx[np.unique(idx)], f  # h5py wants increasing indices; the batches are sorted
    if kind == "sqlite":
        con = sqlite3.connect(f"file:{path / 'data.db'}?mode=ro", uri=True)

        def rows(idx: np.ndarray) -> np.ndarray:
            q = f"SELECT x FROM samples WHERE id IN ({','.join('?' * len(idx))}) ORDER BY id"
            blobs = b"".join(r[0] for r in con.execute(q, idx.tolist()))
            return np.frombuffer(blobs, data.dtype).reshape(len(idx), *data.shape)

        return rows, con
    if kind == "lmdb1":
        import lmdb

        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False)
        txn = env.begin()
        return lambda idx: np.stack([np.frombuffer(txn.get(b"%08d" % i), data.dtype) for i in idx.tolist()]), env
    if kind == "npyfiles":
        return lambda idx: np.stack([np.load(path / f"{i:08d}.npy") for i in idx.tolist()]), None
    if kind == "mds":
        streaming = import_streaming()
        streaming.base.util.clean_stale_shared_memory()
        ds = streaming.StreamingDataset(local=str(path), shuffle=False)
        return lambda idx: np.stack([ds.get_item(i)["x"] for i in idx.tolist()]), None
    if kind == "litdata":
        import litdata

        lds = litdata.StreamingDataset(input_dir=str(path), shuffle=False, batch_decode=0)
        return lambda idx: np.stack([np.asarray(lds[i]["x"]) for i in idx.tolist()]), None
    raise ValueError(f"no random reads of {kind}")


def format_read(kind: str, mode: str) -> Measure:
    """Warm random batches (sorted) of format ``kind`` read by ``mode``, one process (files in the page cache)."""

    def fn(ctx: Ctx) -> dict[str, float]:
        n = min(ctx.data.samples, NPY_FILES) if kind == "npyfiles" else ctx.data.samples
        read, handle = opener(kind, mode, ctx.path(kind), ctx.data)
        try:
            batches = warm_batches(n, ctx.batch, "random", 1, ctx.round)
            x = read(batches[0])
            if not np.array_equal(x.reshape(len(x), -1)[:, 0].astype(np.int64), batches[0] % 1024):
                raise RuntimeError(f"{kind} returned other samples than asked")
            return {"rate": timed(batches[1:WARM_BATCHES], ctx.seconds, lambda b: len(read(b)))}
        finally:
            if handle is not None:
                handle.close()

    return Measure(f"{NAMES[kind]}, {mode} (warm)", fn, uses=(kind,), warm=True)


def peer_epoch(kind: str) -> Measure:
    """A shuffled epoch of a peer through its recommended loader, 2 workers: samples/s after the first batch."""

    def fn(ctx: Ctx) -> dict[str, float]:
        loader = peer_loader(kind, ctx.path(kind), ctx.batch)
        return {"rate": first_then_rate(iter(loader), ctx.seconds)["rate"]}

    return Measure(f"{NAMES[kind]}, shuffled epoch, 2 workers (warm)", fn, uses=(kind,), warm=True)


def peer_loader(kind: str, path: Path, batch: int) -> Iterable[Any]:
    """``(x, y)`` batches of a peer's own loader, shuffled, 2 workers."""
    if kind == "mds":
        streaming = import_streaming()
        streaming.base.util.clean_stale_shared_memory()
        ds = streaming.StreamingDataset(local=str(path), shuffle=True, batch_size=batch, shuffle_seed=1)
        return pairs(streaming.StreamingDataLoader(ds, batch_size=batch, num_workers=2))
    if kind == "litdata":
        import litdata

        lds = litdata.StreamingDataset(input_dir=str(path), shuffle=True, seed=1)
        return pairs(litdata.StreamingDataLoader(lds, batch_size=batch, num_workers=2))
    import webdataset as wds

    urls = [str(p) for p in sorted(path.glob("shard-*.tar"))]
    ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=1, empty_check=False).shuffle(5000).decode()
    return wds.WebLoader(ds.to_tuple("x.npy", "cls").batched(batch, partial=True), batch_size=None, num_workers=2)


def pairs(loader: Iterable[Any]) -> Iterable[Any]:
    for b in loader:
        yield b["x"], b["y"]


def import_streaming() -> Any:
    """MosaicML streaming.  It imports torchvision (for its vision datasets only), whose CUDA wheel does not load
    beside a CPU torch: then a stand-in with the names ``streaming.vision`` imports is used."""
    try:
        import streaming

        return streaming
    except Exception:  # torchvision's C++ ops fail to load
        for mod in [m for m in sys.modules if m.startswith(("torchvision", "streaming"))]:
            del sys.modules[mod]
        tv, ds, tf, fn = (
            types.ModuleType(f"torchvision{s}") for s in ("", ".datasets", ".transforms", ".transforms.functional")
        )
        ds.VisionDataset = ds.CIFAR10 = object  # type: ignore[attr-defined]
        fn.to_tensor = lambda x: x  # type: ignore[attr-defined]
        tv.datasets, tv.transforms, tf.functional = ds, tf, fn  # type: ignore[attr-defined]
        sys.modules.update({m.__name__: m for m in (tv, ds, tf, fn)})
        import streaming

        return streaming


NAMES = {
    "h5": "HDF5 contiguous",
    "h5chunked": "HDF5 chunked (16 samples)",
    "sqlite": "SQLite, BLOB per row",
    "lmdb1": "LMDB, one key per sample",
    "npyfiles": f"one .npy file per sample (first {NPY_FILES:,})",
    "mds": "MosaicML streaming",
    "litdata": "litdata",
    "wds": "webdataset",
}
