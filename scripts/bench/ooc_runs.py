"""The out-of-core benchmark's measurements on one store: cold reads in one process and through the
DataLoader per shuffle order, warm reads against a memmap of the same samples, shuffle quality, the reader's
own memory, a training loop's data wait and the validation accuracy each order reaches.

Also the benchmark's synthetic stores (:func:`make_store`): cheap to generate, self-identifying samples.
Sample ``i`` is standard-normal noise (a fast RNG per batch) with element ``[0, 0]`` set to ``i`` (exact in
float32 up to 2**24), so any read can be checked for landing on the right sample without a second copy of
the data.  Labels are ``i * 7919 mod 5`` (well mixed) or, with ``sorted_classes``, one class after another
(the way a generator writes them).

Not a benchmark itself: ``bench.ooc`` (run as ``python scripts/bench/ooc.py``) drives these.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import WRITE_CHUNK, build_store, make_log, timed
from bench.machine import drop_page_cache, malloc_trim, rss_status
from lmdbstore.config import LoaderConfig, WriterConfig
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.window import WindowBatchSampler, choose_shuffle
from lmdbstore.store.reader import StoreReader

SHAPE = (25, 25)
CLASSES = ["a", "b", "c", "d", "e"]

log = make_log("ooc")


def labels_for(lo: int, hi: int, n: int, sorted_classes: bool) -> np.ndarray:
    """Labels of samples ``lo..hi-1`` of an ``n``-sample store: well mixed, or one class after another."""
    i = np.arange(lo, hi, dtype=np.int64)
    if sorted_classes:
        return (i * len(CLASSES) // max(n, 1)).astype(np.uint8)
    return (i * 7919 % len(CLASSES)).astype(np.uint8)


def self_identifying(n: int, seed: int, sorted_classes: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(x, y)`` chunks of :data:`WRITE_CHUNK` samples, ``x[i, 0, 0] == i``, with a progress line on stdout
    every 64 chunks."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for lo in range(0, n, WRITE_CHUNK):
        hi = min(lo + WRITE_CHUNK, n)
        x = rng.standard_normal((hi - lo, *SHAPE), dtype=np.float32)
        x[:, 0, 0] = np.arange(lo, hi, dtype=np.float32)
        yield x, labels_for(lo, hi, n, sorted_classes)
        if lo % (WRITE_CHUNK * 64) == 0 and lo:
            print(f"  {lo:,} samples written ({(time.perf_counter() - t0):.0f} s)", flush=True)


def make_store(path: Path, n: int, *, seed: int = 0, sorted_classes: bool = False, sync: bool = False) -> None:
    """Write ``n`` self-identifying samples of 25x25 float32 to a new store at ``path`` with the ordinary
    writer (no fsync unless ``sync``: durability is not measured here)."""
    t0 = time.perf_counter()
    cfg = WriterConfig(sync=sync, initial_map_size=max(1 << 30, int(n * 2600 * 1.1)))
    build_store(path, self_identifying(n, seed, sorted_classes), CLASSES, cfg)
    print(f"store of {n:,} samples written in {time.perf_counter() - t0:.0f} s", flush=True)


def drop_cache(path: Path) -> None:
    """Write back and drop the store's data file's cached pages (pages mapped by a live process stay)."""
    drop_page_cache([path / "data.mdb"], sync=True)


def samplers(path: Path, n: int, batch: int, window_mb: int | None, seed: int, prefetch: Any) -> dict[str, Any]:
    """The three orders over the first ``n`` samples: ``random``, ``block`` (``block_buffer`` 2) and ``window``
    (windows of ``window_mb`` MiB, ``None``: the sampler's default; ``prefetch``: the reader's, or ``None``)."""
    with StoreReader(path) as r:
        spv, sb = r.meta.samples_per_value, r.meta.sample_bytes
    idx = np.arange(n)
    return {
        "random": EpochBatchSampler(idx, batch, shuffle="random", seed=seed),
        "block": EpochBatchSampler(idx, batch, shuffle="block", samples_per_value=spv, block_buffer=2, seed=seed),
        "window": WindowBatchSampler(
            idx,
            batch,
            samples_per_value=spv,
            sample_bytes=sb,
            window_bytes=None if window_mb is None else window_mb << 20,
            prefetch=prefetch,
            seed=seed,
        ),
    }


def first_window_load(reader: StoreReader, sampler: WindowBatchSampler) -> float:
    """Read the first window into the page cache (as the sampler's prefetch would) and time it."""
    plan = sampler.plan()
    t0 = time.perf_counter()
    reader.prefetch(plan.chunk_lo[0], plan.chunk_hi[0])
    h = reader._handle()
    assert h.engine is not None
    h.engine.pool().submit(lambda: None).result()  # the advice runs on the pool: wait for it
    # WILLNEED only starts the reads: touch every chunk's first and last bytes to wait for them
    reader.read_batch(np.r_[plan.chunk_lo[0], plan.chunk_hi[0] - 1])
    rate_probe = reader.read_batch(plan.order[: min(len(plan.order), 4096)])
    del rate_probe
    return time.perf_counter() - t0


def one_process(path: Path, n: int, args: argparse.Namespace) -> dict[str, float]:
    """Cold ``read_batch`` samples/s in this process per order (and the liblmdb path, ``positions=False``, in
    random order for a third of the time), the page cache dropped before each; and the first window's load."""
    out: dict[str, float] = {}
    for mode in ("random", "block", "window", "lmdb-random"):
        drop_cache(path)
        reader = StoreReader(path, positions=mode != "lmdb-random")
        s = samplers(path, n, args.batch, args.window_mb, args.seed, reader.prefetch)[mode.replace("lmdb-", "")]
        reader.read_path  # build the table (its time is reported separately)  # noqa: B018
        if mode == "window":
            out["window first-window load s"] = first_window_load(reader, s)
        secs = args.seconds / 3 if mode == "lmdb-random" else args.seconds
        out[mode] = timed(iter(s), secs, lambda b, r=reader: len(r.read_batch(b)))  # type: ignore[misc]
        reader.close()
        log(f"  one process {mode}: {out[mode]:,.0f} samples/s")
    return out


def loader(path: Path, n: int, args: argparse.Namespace) -> dict[str, float]:
    """Cold samples/s through the DataLoader with ``args.workers`` workers per order, timed after the first
    batch (workers started), the page cache dropped before each."""
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader

    out: dict[str, float] = {}
    for mode in ("random", "block", "window"):
        drop_cache(path)
        pre = StoreReader(path)
        s = samplers(path, n, args.batch, args.window_mb, args.seed, pre.prefetch)[mode]
        if mode == "window":
            first_window_load(pre, s)
        ds = LmdbBatchDataset(path)
        dl = make_loader(ds, s, LoaderConfig(batch_size=args.batch, workers=args.workers, persistent_workers=False))
        it = iter(dl)
        next(it)  # workers started
        out[mode] = timed(it, args.seconds, lambda b: len(b[1]))
        del it, dl
        pre.close()
        log(f"  DataLoader x{args.workers} {mode}: {out[mode]:,.0f} samples/s")
    return out


def warm_memmap(r: StoreReader, m: int, npy: Path) -> np.ndarray:
    """A numpy memmap at ``npy`` of the first ``m`` samples of ``r``, every page cached and mapped."""
    mm = np.lib.format.open_memmap(npy, "w+", np.float32, (m, *r.shape))
    for lo in range(0, m, 65536):
        mm[lo : lo + 65536] = r.read_range(lo, min(lo + 65536, m))
    mm.flush()
    del mm
    mm = np.load(npy, mmap_mode="r")
    np.asarray(mm).sum()
    return mm


def warm(path: Path, n: int, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Warm ``read_batch`` against a memmap of the same first ``args.warm_samples`` samples, random and block
    batches, in CPU time (what other processes disturb least); the memmap is written to ``workdir`` and removed."""
    m = min(n, args.warm_samples)
    r = StoreReader(path)
    npy = workdir / "warm.npy"
    mm = warm_memmap(r, m, npy)
    rng = np.random.default_rng(args.seed)
    out: dict[str, float] = {}
    rand = [np.sort(rng.integers(0, m, args.batch)) for _ in range(64)]
    blocks = [b for b in samplers(path, m, args.batch, args.window_mb, args.seed, None)["block"]][:64]
    for name, bs in (("random", rand), ("block", blocks)):
        for _ in range(2):  # warm-up pass, then the measured ones
            for b in bs:
                r.read_batch(b)
        t0 = time.process_time()
        for b in bs:
            r.read_batch(b)
        out[name] = len(bs) * args.batch / (time.process_time() - t0)
        t0 = time.process_time()
        for b in bs:
            mm[b]
        out[f"memmap {name}"] = len(bs) * args.batch / (time.process_time() - t0)
        log(f"  warm {name}: {out[name]:,.0f} vs memmap {out[f'memmap {name}']:,.0f} samples/s (CPU time)")
    r.close()
    npy.unlink()
    return out


def quality(path: Path, n: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per order, over its first 200 batches: distinct packed values per batch, and the class mix's total
    variation distance from the store's class shares."""
    with StoreReader(path) as r:
        labels, spv, k = r.labels(), r.meta.samples_per_value, len(r.classes)
    share = np.bincount(labels, minlength=k) / len(labels)
    out: dict[str, dict[str, float]] = {}
    for mode, s in samplers(path, n, args.batch, args.window_mb, args.seed, None).items():
        bs = s.batches()[:200]
        distinct = np.mean([len(np.unique(b // spv)) for b in bs])
        tvd = np.mean([0.5 * np.abs(np.bincount(labels[b], minlength=k) / len(b) - share).sum() for b in bs])
        out[mode] = {"distinct values per batch": float(distinct), "class-mix TVD": float(tvd)}
    return out


def rss_anon_mb() -> float:
    """This process's anonymous resident memory in MiB (NaN where /proc does not tell)."""
    return rss_status().get("RssAnon", float("nan"))


def memory(path: Path) -> dict[str, float]:
    """The reader's own memory: position table size and build time, anonymous RSS after open and one batch
    (before and after :func:`malloc_trim`), and the label table's size."""
    malloc_trim()  # a baseline without heap memory freed earlier (building the store) that glibc kept
    before = rss_anon_mb()
    r = StoreReader(path)
    t0 = time.perf_counter()
    r.read_path  # noqa: B018
    h = r._handle()
    table_mb = 0.0 if h.table is None else h.table.offsets.nbytes / 2**20
    out = {"table build s": time.perf_counter() - t0, "table MB": table_mb}
    r.read_batch(np.random.default_rng(0).integers(0, len(r), 4096))
    out["reader RssAnon MB"] = rss_anon_mb() - before
    malloc_trim()  # freed batch buffers that glibc kept: count only what the reader holds
    out["reader RssAnon after trim MB"] = rss_anon_mb() - before
    out["labels MB"] = r.labels().nbytes / 2**20
    r.close()
    return out


def train_wait(path: Path, n: int, args: argparse.Namespace) -> dict[str, float]:
    """A CPU training loop of ``args.train_steps`` steps in the order ``choose_shuffle`` picks for this store,
    on a dropped page cache: samples/s and the share of time spent waiting for data."""
    import torch

    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
    from lmdbstore.training.model import build_model

    choice = choose_shuffle(os.path.getsize(path / "data.mdb"))
    log(f"  training: shuffle {choice.shuffle} ({choice.reason})")
    drop_cache(path)
    pre = StoreReader(path)
    s = samplers(path, n, args.batch, None, args.seed, pre.prefetch)[choice.shuffle]  # default window size
    ds = LmdbBatchDataset(path)
    model = build_model(ds.shape, 5).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    dl = make_loader(ds, s, LoaderConfig(batch_size=args.batch, workers=args.workers))
    wait = total = 0.0
    waits = []
    t_start = time.perf_counter()
    it = iter(dl)
    for _step in range(args.train_steps):
        t0 = time.perf_counter()
        x, y = next(it)
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        waits.append(t1 - t0)
        wait += t1 - t0
    total = time.perf_counter() - t_start
    del it, dl
    pre.close()
    steady = sum(waits[len(waits) // 2 :]) / max(1e-9, total * (len(waits) - len(waits) // 2) / len(waits))
    return {
        "shuffle": choice.shuffle,  # type: ignore[dict-item]
        "steps": args.train_steps,
        "samples/s": args.train_steps * args.batch / total,
        "data wait share": wait / total,
        "data wait share, second half": steady,
        "first batch wait s": waits[0],
    }


def accuracy(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Validation accuracy of random, window and block order on a class-sorted store (one class after
    another, the way a generator writes them): same model, data, steps and seed; only the order differs."""
    import torch

    from lmdbstore.frameworks.torch_data import LmdbBatchDataset
    from lmdbstore.ingestion.synth import SYNTH_CLASSES, synth_batches
    from lmdbstore.loader.samplers import stratified_split
    from lmdbstore.training.model import build_model

    x, y = next(synth_batches(args.accuracy, seed=args.seed, batch=args.accuracy))
    order = np.argsort(y, kind="stable")
    path = workdir / "sorted"
    build_store(path, [(x[order], y[order])], SYNTH_CLASSES, WriterConfig(sync=False))
    ds = LmdbBatchDataset(path)
    with StoreReader(path) as r:
        spv, sb, labels = r.meta.samples_per_value, r.meta.sample_bytes, r.labels()
    tr, va = stratified_split(labels, 0.1, args.seed)
    window_bytes = len(tr) * sb // 8  # an eighth of the data per window, as out of core
    out: dict[str, float] = {}
    for mode in ("random", "window", "block"):
        torch.manual_seed(args.seed)
        model = build_model(ds.shape, len(SYNTH_CLASSES))
        opt = torch.optim.AdamW(model.parameters(), 3e-3)
        if mode == "window":
            s: Any = WindowBatchSampler(tr, 256, samples_per_value=spv, sample_bytes=sb, window_bytes=window_bytes)
        else:
            s = EpochBatchSampler(tr, 256, shuffle=mode, samples_per_value=spv, block_buffer=1, seed=args.seed)  # type: ignore[arg-type]
        for epoch in range(2):
            s.set_epoch(epoch)
            model.train()
            for b in s:
                xb, yb = ds[b]
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(ds[b][0]).argmax(1) == ds[b][1]).sum()) for b in np.array_split(va, 8))
        out[mode] = correct / len(va)
        log(f"  class-sorted store, {mode}: validation accuracy {out[mode]:.3f}")
    ds.reader.close()
    shutil.rmtree(path)
    return out
