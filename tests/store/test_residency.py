"""Exact page-cache residency on the offset read path (lmdbstore.store.residency, lmdbstore.store.preads).

Pages are dropped from the page cache with ``posix_fadvise(DONTNEED)`` (after the reader's own map let go of
them), so each test knows, from an independent ``mincore`` on a map of its own, which bytes are cached; every
batch's content is compared with the written samples, and the engine's counters say which runs went to the
I/O threads: exactly the runs that were not cached, never a cached one (no timers decide).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import StoreInfo, build_store, make_data

from lmdbstore.store.preads import PreadEngine
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.residency import CALL_PAGES, Residency, major_faults

N = 6000  # 25x25 float32 samples: 15 MB, 18 samples per value


def _build(path: Path) -> None:
    build_store(path, *make_data(N, seed=21))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> StoreInfo:
    """Written by another process: the writer's environment (shared in a process) maps no page here."""
    path = tmp_path_factory.mktemp("residency") / "store"
    p = mp.get_context("fork").Process(target=_build, args=(path,))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    drop(path, None)  # the writer's pages may be large folios that a few mapped bytes keep whole: read anew
    return StoreInfo(path, *make_data(N, seed=21))


def engine_of(r: StoreReader) -> PreadEngine:
    r.read_batch(np.arange(N))  # table built, every header checked, every page cached
    h = r._handle()
    assert h.engine is not None and r.read_path == "positions"
    return h.engine


def drop(path: Path, engine: PreadEngine | None, lo: int = 0, hi: int | None = None) -> None:
    """Drop bytes ``lo..hi`` of the data file from the page cache (and from the engine's map first: a mapped
    page is not dropped)."""
    data = path / "data.mdb"
    hi = os.path.getsize(data) if hi is None else hi
    if engine is not None and engine._map is not None:
        a = lo - lo % mmap.PAGESIZE
        engine._map.madvise(mmap.MADV_DONTNEED, a, min(hi, engine.file_size) - a)
    fd = os.open(data, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(3):  # pages just written may sit in another CPU's LRU batch for a moment
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
            time.sleep(0.02)
    finally:
        os.close(fd)


def cached_truth(path: Path, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Whether each byte run is in the page cache, asked through a map of this test's own."""
    data = path / "data.mdb"
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        arr = np.frombuffer(m, np.uint8)
        res = Residency(arr.ctypes.data, len(m))
        got = res.cached(offs, lens)
        del arr
    return got


def runs_of(r: StoreReader, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The file bytes of each sample of ``idx`` (one run per sample: random batches)."""
    table = r._table
    assert table is not None
    sb = r.meta.sample_bytes
    v = idx // table.samples_per_value
    return table.offsets[v] + (idx - v * table.samples_per_value) * sb, np.full(len(idx), sb)


def reset(e: PreadEngine) -> None:
    e.stats = dict.fromkeys(e.stats, 0)


def dropped(store: StoreInfo, r: StoreReader, e: PreadEngine) -> np.ndarray:
    """Drop the file from the page cache; the samples whose bytes left it (liblmdb's own map keeps a few)."""
    drop(store.path, e)
    e.residency().distrust()  # as the next fault would tell it (test_a_trusted_map_that_lies...)
    every = np.arange(N)
    return every[~cached_truth(store.path, *runs_of(r, every))]


def test_warm_batches_never_reach_the_io_threads(store: StoreInfo) -> None:
    with StoreReader(store.path) as r:
        e = engine_of(r)
        reset(e)
        rng = np.random.default_rng(0)
        for _ in range(20):
            for b in (rng.integers(0, N, 500), np.arange(s := int(rng.integers(0, N - 700)), s + 700)):
                out = np.empty((len(b), 25, 25), np.float32)
                assert r.read_batch(b, out=out).tobytes() == store.x[b].tobytes()
                assert r.read_batch(b).tobytes() == store.x[b].tobytes()
        assert e.stats["pread_runs"] == 0 and e.stats["pread_batches"] == 0
        assert e.stats["copied_runs"] > 0
        assert e.residency().trusted  # checks cost as much as one look at the whole file: trusted since


def test_cold_batches_read_exactly_the_missing_runs(store: StoreInfo) -> None:
    with StoreReader(store.path) as r:
        e = engine_of(r)
        cold = dropped(store, r, e)
        if len(cold) < N // 2:
            pytest.skip("this file system keeps the pages cached (fadvise DONTNEED has no effect)")
        b = cold[np.r_[True, np.diff(cold // 18) > 0]][::3]  # one sample per value: one run each
        reset(e)
        assert r.read_batch(b).tobytes() == store.x[b].tobytes()
        assert e.stats["pread_runs"] == len(b) and e.stats["copied_runs"] == 0
        reset(e)
        assert r.read_batch(b).tobytes() == store.x[b].tobytes()  # now cached: read by the preads just done
        assert e.stats["pread_runs"] == 0


def test_mixed_batches_split_by_what_is_cached(store: StoreInfo) -> None:
    with StoreReader(store.path) as r:
        e = engine_of(r)
        table = r._table
        assert table is not None
        half = int(table.offsets[table.offsets.size // 2])
        drop(store.path, e, half)  # the second half of the values leaves the cache
        e.residency().distrust()  # as the next fault would tell it (test_a_trusted_map_that_lies...)
        rng = np.random.default_rng(2)
        for b in (rng.integers(0, N, 400), np.sort(rng.integers(0, N, 400)), np.arange(N // 2 - 500, N // 2 + 500)):
            offs, lens = runs_of(r, b)
            truth = cached_truth(store.path, offs, lens)
            if truth.all():
                pytest.skip("this file system keeps the pages cached (fadvise DONTNEED has no effect)")
            reset(e)
            assert r.read_batch(b).tobytes() == store.x[b].tobytes()
            assert e.stats["pread_runs"] > 0 and e.stats["copied_runs"] > 0
            if len(np.unique(b)) == len(b) and not (np.diff(np.sort(b)) == 1).any():  # one run per sample
                assert e.stats["pread_runs"] == int((~truth).sum())
            drop(store.path, e, half)
            e.residency().distrust()


def test_a_trusted_map_that_lies_is_corrected_by_the_kernel(store: StoreInfo) -> None:
    """Pages leave the cache behind a trusted map: the copy faults (right bytes, read by the fault), the major
    fault says so, and the next batch is checked page by page."""
    with StoreReader(store.path) as r:
        e = engine_of(r)
        res = e.residency()
        res.refresh()
        assert res.trusted and res.pages[: res.npages].all()
        cold = dropped(store, r, e)
        if len(cold) < N // 2:
            pytest.skip("this file system keeps the pages cached (fadvise DONTNEED has no effect)")
        res.refresh()  # an old picture of the cache...
        res.pages[: res.npages] = 1  # ...that says everything is cached
        b = cold[::7]
        before = major_faults()
        assert r.read_batch(b).tobytes() == store.x[b].tobytes()
        if before < 0 or major_faults() == before:
            pytest.skip("no per-thread major fault count here")
        assert not res.trusted
        drop(store.path, e)
        reset(e)
        assert r.read_batch(b).tobytes() == store.x[b].tobytes()
        assert e.stats["pread_runs"] > 0  # checked exactly now: the dropped pages went to the threads


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def test_a_loaded_machine_and_many_buffers_change_nothing(store: StoreInfo) -> None:
    """The decision is the kernel's answer: busy cores and lots of memory in use send no cached batch to the
    I/O threads (timers did: 20-40 % of cached batches under load, issue 21)."""
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 2)]
    for p in spinners:
        p.start()
    try:
        with StoreReader(store.path) as r:
            e = engine_of(r)
            reset(e)
            rng = np.random.default_rng(3)
            held = []
            t_end = time.monotonic() + 1.0
            while time.monotonic() < t_end:
                b = rng.integers(0, N, 256)
                held.append((b, r.read_batch(b)))
                s = int(rng.integers(0, N - 256))
                held.append((np.arange(s, s + 256), r.read_batch(np.arange(s, s + 256))))
            assert all(x.tobytes() == store.x[b].tobytes() for b, x in held)
            assert e.stats["pread_runs"] == 0 and e.stats["batches"] >= 2
    finally:
        stop.set()
        for p in spinners:
            p.join(10)


def test_residency_checks_clusters_and_marks(tmp_path: Path) -> None:
    """Runs close together are checked by one call; marks and distrust do what they say."""
    f = tmp_path / "f"
    f.write_bytes(os.urandom(1024 * mmap.PAGESIZE))  # more pages than a few checks cost
    fh = open(f, "rb")  # noqa: SIM115
    m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    arr = np.frombuffer(m, np.uint8)
    try:
        res = Residency(arr.ctypes.data, len(m))
        p = mmap.PAGESIZE
        assert res.cached(np.array([0, 10 * p - 1, 500 * p]), np.array([1, 2, 10])).all()
        assert res.spent == 2 * CALL_PAGES + 11 + 1  # pages 0..10 in one call (close together), 500 in one
        assert not res.trusted  # checks so far cost less than one look at the whole file
        res.refresh()
        assert res.trusted and res.pages[: res.npages].all()
        res.pages[5] = 0
        assert res.cached(np.array([5 * p]), np.array([1])).all()  # not known: asked again
        res.distrust()
        assert not res.trusted
        res.pages[:] = 0
        res.mark(np.array([0]), np.array([3 * p]))
        assert res.pages[:3].all() and not res.pages[3:].any()
        assert res.cached(np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0,)
    finally:
        del arr  # the map closes when its last view is gone
        fh.close()


def _build_set(paths: list[Path]) -> None:
    for i, p in enumerate(paths):
        build_store(p, *make_data(N // 3, seed=40 + i))


def test_a_set_reads_each_store_by_what_the_kernel_says(tmp_path: Path) -> None:
    """A set of three stores, one dropped from the page cache: grouped batches come out exact, the warm
    stores' parts are copied (no pread), the cold store's missing runs go to its I/O threads."""
    from lmdbstore.store.multi import StoreSet

    paths = [tmp_path / f"s{i}" for i in range(3)]
    p = mp.get_context("fork").Process(target=_build_set, args=(paths,))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    for path in paths:
        drop(path, None)
    x = np.concatenate([make_data(N // 3, seed=40 + i)[0] for i in range(3)])
    with StoreSet(paths) as s:
        s.read_batch(np.arange(len(s)))  # every table built and header checked, every page cached
        engines = [engine_of_reader(r) for r in s.readers]
        rng = np.random.default_rng(7)
        for e in engines:
            reset(e)
        for _ in range(5):
            b = np.sort(rng.integers(0, len(s), 600))
            assert s.read_batch(b).tobytes() == x[b].tobytes()
        assert all(e.stats["pread_runs"] == 0 for e in engines)
        drop(paths[1], engines[1])
        engines[1].residency().distrust()
        cold = dropped_samples(paths[1], s.readers[1])
        if len(cold) < N // 6:
            pytest.skip("this file system keeps the pages cached (fadvise DONTNEED has no effect)")
        b = np.sort(rng.integers(0, len(s), 600))
        for e in engines:
            reset(e)
        assert s.read_batch(b).tobytes() == x[b].tobytes()
        assert engines[1].stats["pread_runs"] > 0
        assert engines[0].stats["pread_runs"] == 0 and engines[2].stats["pread_runs"] == 0


def engine_of_reader(r: StoreReader) -> PreadEngine:
    h = r._handle()
    assert h.engine is not None
    return h.engine


def dropped_samples(path: Path, r: StoreReader) -> np.ndarray:
    every = np.arange(len(r))
    return every[~cached_truth(path, *runs_of(r, every))]


@pytest.mark.parametrize("world", [1, 2])
def test_window_order_reads_ahead_and_reads_exactly_across_epochs_and_ranks(store: StoreInfo, world: int) -> None:
    """Cold store, window order with the reader's read-ahead, two epochs, one or two ranks: every batch exact,
    each epoch every sample once over the ranks, and batches of a window still loading read what they need
    themselves (the first batch does not wait for its window)."""
    from lmdbstore.loader.window import WindowBatchSampler

    with StoreReader(store.path) as r:
        e = engine_of(r)
        for epoch in range(2):
            dropped(store, r, e)
            seen = []
            for rank in range(world):
                s = WindowBatchSampler(
                    np.arange(N),
                    256,
                    samples_per_value=18,
                    sample_bytes=2500,
                    window_bytes=2 << 20,
                    chunk_bytes=1 << 18,
                    prefetch=r.prefetch,
                    seed=3,
                    rank=rank,
                    world_size=world,
                )
                s.set_epoch(epoch)
                reset(e)
                for b in s:
                    assert r.read_batch(b).tobytes() == store.x[b].tobytes()
                    seen.append(b)
                assert e.stats["batches"] > 0
            every = np.sort(np.concatenate(seen))
            assert np.array_equal(every, np.arange(N))


@pytest.mark.parametrize(("shape", "dtype"), [((200, 200), np.float32), ((3, 7), np.int16), ((5,), np.float64)])
def test_warm_gathers_of_every_sample_size_are_exact(store_factory: Any, shape: tuple[int, ...], dtype: Any) -> None:
    """The row gather (random batches) and the run copies (block batches), with and without ``out``, for samples
    larger than a gather chunk, small odd ones and tiny ones (many per page); repeats and any order."""
    info = store_factory(300, seed=5, shape=shape, dtype=dtype)
    rng = np.random.default_rng(9)
    with StoreReader(info.path) as r:
        r.read_batch(np.arange(300))
        for b in (rng.integers(0, 300, 64), np.r_[5, 5, 299, 0, 5], np.arange(40, 140), rng.permutation(300)):
            assert r.read_batch(b).tobytes() == info.x[b].tobytes()
            out = np.full((len(b), *shape), 7, dtype)
            r.read_batch(b, out=out)
            assert out.tobytes() == info.x[b].tobytes()
        engine = r._handle().engine
        assert engine is not None and engine.stats["pread_runs"] == 0


def test_the_page_map_lookup_agrees_with_page_by_page(tmp_path: Path) -> None:
    """Runs of 0..40 pages (short ones looked up page by page, long ones reduced) against a direct check."""
    f = tmp_path / "f"
    f.write_bytes(b"\0" * (300 * mmap.PAGESIZE))
    fh = open(f, "rb")  # noqa: SIM115
    m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    arr = np.frombuffer(m, np.uint8)
    try:
        res = Residency(arr.ctypes.data, len(m))
        rng = np.random.default_rng(0)
        pages = (rng.random(res.npages) < 0.9).astype(np.uint8)
        p = mmap.PAGESIZE
        for max_pages in (1, 3, 15, 40):
            starts = rng.integers(0, 250 * p, 500)
            lens = rng.integers(1, max_pages * p, 500)
            res.pages[: res.npages] = pages
            res.trusted = True
            got = res._known(*res._span(starts, lens))
            want = [pages[s // p : (s + n - 1) // p + 1].all() for s, n in zip(starts, lens, strict=True)]
            assert got.tolist() == want
    finally:
        del arr
        fh.close()
