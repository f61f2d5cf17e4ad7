"""Reads by file offset (lmdbstore.store.fileread, lmdbstore/store/batchread.c): one compiled call per batch, and its
fallback (``os.preadv`` in turn, where the extension was not built).

Every read path is run both ways and compared with the samples written and with liblmdb's bytes: every sample size,
random, block and window batches, with and without ``out``, warm, cold and half-cached, a set of stores.  Pages are
dropped with ``posix_fadvise(DONTNEED)`` (after the reader's own map let go of them), and an independent ``mincore``
says what is cached: cold runs are read (the reader's counters), warm ones copied from the map, a block-like cold
run brings its whole value, a short one only its bytes; a page map that lies is corrected by the next major fault.
A file truncated in a loop under reads -- by offset and liblmdb's own -- gives one-line errors, never a signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REPO, StoreInfo, build_store, make_data

from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.window import WindowBatchSampler
from lmdbstore.store import fileread
from lmdbstore.store.fileread import FileReader
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader

compiled = pytest.mark.skipif(fileread.COMPILED is None, reason="the compiled reader was not built here")
linux = pytest.mark.skipif(sys.platform != "linux", reason="mincore, fadvise and /proc are Linux's")
N = 6000  # 25x25 float32 samples: 15 MB, 18 samples per value


@pytest.fixture(params=["compiled", "preadv"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test twice: with the compiled reader (where it was built) and with the fallback."""
    if request.param == "compiled":
        if fileread.COMPILED is None:
            pytest.skip("the compiled reader was not built here")
    else:
        monkeypatch.setattr(fileread, "COMPILED", None)
    yield request.param


def files_of(r: StoreReader) -> FileReader:
    h = r._handle()
    assert h.files is not None
    return h.files


def drop(path: Path, r: StoreReader | None = None) -> None:
    """Drop the data file's pages from the page cache (the reader's map lets go of them first), and make the reader
    forget what it knew of them (as its next major fault would)."""
    if r is not None and r._h is not None and r._h.files is not None:
        f = r._h.files
        if f._map is not None:
            f._map.madvise(mmap.MADV_DONTNEED)
        f.state[0] = 0
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(3):  # pages just written may sit in another CPU's LRU batch for a moment
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            time.sleep(0.02)
    finally:
        os.close(fd)


def cached(path: Path, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Whether each byte run of the data file is in the page cache, asked through a map of this test's own."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path / "data.mdb", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        arr = np.frombuffer(m, np.uint8)
        vec = np.zeros(len(m) // mmap.PAGESIZE + 1, np.uint8)
        assert libc.mincore(arr.ctypes.data, len(m), vec.ctypes.data) == 0
        del arr
    p0, p1 = offs // mmap.PAGESIZE, (offs + lens - 1) // mmap.PAGESIZE
    return np.array([bool((vec[a : b + 1] & 1).all()) for a, b in zip(p0.tolist(), p1.tolist(), strict=True)])


def batches(info: StoreInfo, rng: np.random.Generator, spv: int) -> list[np.ndarray]:
    """Random (repeats, any order), block (sorted pieces of values), window (unsorted runs) and odd batches."""
    n = len(info.x)
    block = EpochBatchSampler(np.arange(n), 97, shuffle="block", samples_per_value=spv, block_buffer=2, seed=3)
    window = WindowBatchSampler(np.arange(n), 97, samples_per_value=spv, sample_bytes=info.x[0].nbytes, seed=3)
    return [
        rng.integers(0, n, 300),
        np.sort(rng.integers(0, n, 300)),
        *list(block)[:3],
        *list(window)[:2],
        np.arange(n)[::-1][:150],
        np.array([n - 1, 0, n - 1, 5]),
        np.arange(min(n, 3 * spv + 2)),
    ]


def read_all_ways(r: StoreReader, info: StoreInfo, bs: list[np.ndarray]) -> None:
    for b in bs:
        assert r.read_batch(b).tobytes() == info.x[b].tobytes()
        out = np.full((len(b), *info.x.shape[1:]), 7, info.x.dtype)
        assert r.read_batch(b, out=out) is out and out.tobytes() == info.x[b].tobytes()


@pytest.mark.parametrize(
    ("shape", "dtype"), [((25, 25), np.float32), ((5,), np.float64), ((3, 7), np.int16), ((130, 130), np.float32)]
)
def test_every_read_path_is_exact_against_liblmdb(
    route: str, store_factory: Any, shape: tuple[int, ...], dtype: Any
) -> None:
    info = store_factory(150 if np.prod(shape) > 4096 else 700, seed=8, shape=shape, dtype=dtype)  # 10 MB at most
    rng = np.random.default_rng(4)
    with StoreReader(info.path) as r, StoreReader(info.path, positions=False) as ref:
        bs = batches(info, rng, r.meta.samples_per_value)
        for b in bs:  # liblmdb's bytes are the written ones
            assert ref.read_batch(b).tobytes() == info.x[b].tobytes()
        read_all_ways(r, info, bs)  # cold headers, then warm
        read_all_ways(r, info, bs)
        drop(info.path, r)
        read_all_ways(r, info, bs)  # cold pages
        drop(info.path, r)
        r.read_batch(np.arange(0, len(info.x), 3))  # a third of the samples cached again
        read_all_ways(r, info, bs)


def test_a_set_reads_exactly_grouped_or_not(route: str, tmp_path: Path) -> None:
    xs = [make_data(n, seed=20 + i) for i, n in enumerate((300, 41, 500))]
    paths = [build_store(tmp_path / f"s{i}", x, y) for i, (x, y) in enumerate(xs)]
    x = np.concatenate([x for x, _ in xs])
    rng = np.random.default_rng(5)
    with StoreSet(paths) as s:
        for _ in range(2):
            for b in (rng.integers(0, len(x), 400), np.sort(rng.integers(0, len(x), 400)), np.arange(280, 360)):
                g = b[np.argsort(s.store_of(b), kind="stable")]
                for batch in (b, g):
                    assert s.read_batch(batch).tobytes() == x[batch].tobytes()
                    out = np.zeros((len(batch), 25, 25), np.float32)
                    assert s.read_batch(batch, out=out).tobytes() == x[batch].tobytes()
            for p, rd in zip(paths, s.readers, strict=True):
                drop(p, rd)


def _build(path: Path) -> None:
    build_store(path, *make_data(N, seed=21))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> StoreInfo:
    """Written by another process: the writer's environment (shared in a process) maps no page here."""
    path = tmp_path_factory.mktemp("fileread") / "store"
    p = mp.get_context("fork").Process(target=_build, args=(path,))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    drop(path)
    return StoreInfo(path, *make_data(N, seed=21))


@contextlib.contextmanager
def cold_reader(store: StoreInfo) -> Iterator[tuple[StoreReader, FileReader, np.ndarray]]:
    """A reader of the store, every value located and its pages dropped; the offsets of the values whose pages all
    left the cache (skip when too few did: fadvise DONTNEED keeps what a map of this process still holds)."""
    with StoreReader(store.path) as r:
        r.read_batch(np.arange(N))
        f, table = files_of(r), r._table
        assert table is not None and table.complete
        drop(store.path, r)
        offs = table.offsets[:-1]
        pages = (offs - 16)[:, None] + np.arange(0, 18 * 2500 + 16, 4096)[None, :]
        gone = ~cached(store.path, pages.ravel(), np.ones(pages.size, np.int64)).reshape(pages.shape).any(axis=1)
        if gone.sum() < len(offs) // 2:
            pytest.skip("this file system keeps the pages cached (fadvise DONTNEED has no effect)")
        f.state[:] = 0
        yield r, f, np.flatnonzero(gone)


@compiled
def test_warm_batches_are_copied_and_cold_runs_read(store: StoreInfo) -> None:
    """Once the page map is trusted (a few warm batches), warm batches are copies from the map, no read; after the
    pages are dropped every run is read, and the same batch again is copied."""
    with StoreReader(store.path) as r:
        r.read_batch(np.arange(N))
        f = files_of(r)
        rng = np.random.default_rng(0)
        for _ in range(6):
            r.read_batch(rng.integers(0, N, 500))
        assert f.stats["trusted"]
        f.state[2:] = 0
        for _ in range(10):
            for b in (rng.integers(0, N, 500), np.arange(s := int(rng.integers(0, N - 700)), s + 700)):
                out = np.empty((len(b), 25, 25), np.float32)
                assert r.read_batch(b, out=out).tobytes() == store.x[b].tobytes()
        assert f.stats["read"] == 0 and f.stats["copied"] > 0
    with cold_reader(store) as (r, f, gone):
        b = gone[::3] * 18 + 5  # one sample of values wholly dropped: one run each
        assert r.read_batch(b).tobytes() == store.x[b].tobytes()
        assert f.stats["read"] == len(b) and f.stats["copied"] == 0


@compiled
def test_a_page_map_that_lies_is_corrected_by_the_next_major_fault(store: StoreInfo) -> None:
    """Pages leave the cache behind a trusted page map: the copy faults (right bytes, read by the fault), the major
    fault says so, and the rest of the batch and the next ones are read."""
    with cold_reader(store) as (r, f, gone):
        f.pages[:] = 1  # an old picture of the cache that says everything is cached
        f.state[0] = 1
        b = gone[: 40 * 3 : 3] * 18 + 7
        assert r.read_batch(b).tobytes() == store.x[b].tobytes()
        assert not f.stats["trusted"]
        drop(store.path, r)
        f.state[2:] = 0
        assert r.read_batch(b).tobytes() == store.x[b].tobytes()
        assert f.stats["read"] == len(b)


@compiled
def test_a_cold_piece_of_a_value_brings_the_rest_of_it(store: StoreInfo) -> None:
    """Block order reads a value in pieces over several batches: the first piece read from the disk reads the
    whole value, so the next piece is a copy from the page cache; a short run (random order) reads only its own
    bytes."""
    with cold_reader(store) as (r, _f, gone):
        v = gone[:3]
        offs = r._table.offsets  # type: ignore[union-attr]
        first = np.concatenate([np.arange(k * 18 + 5, k * 18 + 11) for k in v.tolist()])  # samples 5..10
        assert r.read_batch(first).tobytes() == store.x[first].tobytes()
        assert cached(store.path, offs[v], np.full(3, 18 * 2500)).all()  # the whole values
        w = gone[len(gone) // 2 :: 7][:3]  # values far from those
        short = w * 18 + 9
        assert r.read_batch(short).tobytes() == store.x[short].tobytes()
        assert not cached(store.path, offs[w], np.full(3, 4096)).any()  # not their first pages
        assert cached(store.path, offs[w] + 9 * 2500, np.full(3, 2500)).all()


def test_window_order_reads_ahead_and_reads_exactly_across_epochs(store: StoreInfo) -> None:
    """Cold store, window order with the reader's read-ahead, two epochs: every batch exact, every sample once."""
    with StoreReader(store.path) as r:
        for epoch in range(2):
            drop(store.path, r)
            s = WindowBatchSampler(
                np.arange(N), 256, samples_per_value=18, sample_bytes=2500, window_bytes=2 << 20,
                chunk_bytes=1 << 18, prefetch=r.prefetch, seed=3,
            )  # fmt: skip
            s.set_epoch(epoch)
            seen = []
            for b in s:
                assert r.read_batch(b).tobytes() == store.x[b].tobytes()
                seen.append(b)
            assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(N))


def test_io_threads_is_a_setting(store: StoreInfo) -> None:
    with pytest.raises(ValueError, match="io_threads"):
        StoreReader(store.path, io_threads=0)
    for threads in (1, 3):
        with StoreReader(store.path, io_threads=threads) as r:
            drop(store.path, r)
            assert r.read_batch(np.arange(0, N, 5)).tobytes() == store.x[::5].tobytes()
            assert files_of(r).threads == threads
    with StoreSet([store.path], io_threads=4) as s:
        assert s.readers[0].io_threads == 4


@compiled
def test_the_compiled_reader_refuses_buffers_too_short() -> None:
    c = fileread.COMPILED
    assert c is not None
    i64, z = np.zeros(4, np.int64), np.zeros(4, bool)
    buffers = [np.zeros(2, np.uint8), np.zeros(4, np.int64), np.zeros(8, np.uint8), i64, i64, z]
    part = [0, 0, 0, 64, *buffers, 1, 4, 0, 4, 4, 0]  # fd, rfd, map, size, buffers, spv, sb, psize, count, vlen, extend
    with pytest.raises(ValueError, match="too short"):
        c.read(1, [tuple(part)])  # 8 bytes of dst for 4 samples of 4
    part[6], part[7] = np.zeros(16, np.uint8), i64.astype(np.int32)
    with pytest.raises(TypeError, match="8-byte"):
        c.read(1, [tuple(part)])


_SHRINK = """
import faulthandler, os, sys
import numpy as np
from lmdbstore.store.fileread import DEST, OK, SOURCE, FileReader
f, g = sys.argv[1], sys.argv[2]
with open(f, "wb") as fh:
    fh.write(bytes(range(256)) * 64)  # 4 pages
fd = os.open(f, os.O_RDONLY)
r = FileReader(fd, 16384)
offs, one = np.array([5, 9000], np.int64), np.ones(2, bool)
out = np.zeros(200, np.uint8)
layout = (1, 100, 0, 2, 100)
for _ in range(8):  # the page map trusted: later batches are copies from the map
    assert r.read(out, np.arange(2), offs, one, layout) == (OK, 0)
assert r.stats["trusted"] and out[100:].tolist() == [(9000 + i) % 256 for i in range(100)]
os.truncate(f, 4096)  # pages 1 to 3 gone: touching them is SIGBUS
with open(g, "wb") as fh:
    fh.write(bytes(8192))
gd = os.open(g, os.O_RDWR)
import mmap
far = np.frombuffer(mmap.mmap(gd, 8192), np.uint8)  # a destination that maps a file...
os.ftruncate(gd, 0)  # ...truncated: writing it is SIGBUS
for handler in (False, True):  # with faulthandler's SIGBUS handler installed before the copies, too
    if handler:
        faulthandler.enable()
    r.state[0] = 1
    assert r.read(out, np.arange(2), offs, one, layout)[0] == SOURCE
    assert "truncated" in str(r.fail(SOURCE, 0))
    r.state[0] = 1
    assert r.read(out, np.arange(1), offs, one, layout) == (OK, 0)  # page 0 is still there
    r.state[0] = 1
    assert r.read(far, np.arange(1), offs, one, layout)[0] == DEST  # the destination's page, not the map's
print("survived")
"""


@compiled
@linux
def test_a_copy_of_pages_past_the_end_of_a_shrunk_file_is_told_not_sigbus(tmp_path: Path) -> None:
    """In a child process: were SIGBUS not caught, it would kill the child, not this test run."""
    p = subprocess.run(
        [sys.executable, "-c", _SHRINK, str(tmp_path / "f"), str(tmp_path / "g")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert p.returncode == 0 and p.stdout.strip() == "survived", (p.returncode, p.stderr[-2000:])


READER = r"""
import collections, json, sys, time
import numpy as np
from lmdbstore import LmdbStoreError, StoreReader
path, secs, xfile = sys.argv[1], float(sys.argv[2]), sys.argv[3]
x = np.load(xfile)
n = len(x)
r = StoreReader(path)
r.read_batch(np.arange(n))  # warm, every value located
r2 = StoreReader(path, positions=False)
rng = np.random.default_rng(0)
stats = collections.Counter()
print("READY", flush=True)
end = time.monotonic() + secs
while time.monotonic() < end:
    for kind in ("random", "block", "lmdb", "labels"):
        try:
            if kind == "random":
                idx = rng.integers(0, n, 8192)
                assert (r.read_batch(idx) == x[idx]).all()
            elif kind == "block":
                lo = int(rng.integers(0, n - 4096))
                assert (r.read_batch(np.arange(lo, lo + 4096)) == x[lo : lo + 4096]).all()
            elif kind == "lmdb":
                idx = rng.integers(0, n, 256)
                assert (r2.read_batch(idx) == x[idx]).all()
            else:
                r.refresh()
                r.labels()
            stats["ok"] += 1
        except LmdbStoreError as exc:
            assert "\n" not in str(exc), str(exc)
            stats[type(exc).__name__] += 1
print(json.dumps(stats), flush=True)
"""

TRUNCATE = r"""
import os, sys, time
path, secs, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
orig = open(path, "rb").read()
cut = len(orig) // 3
end = time.monotonic() + secs
if mode == "open":  # each truncation opens the file
    while time.monotonic() < end:
        os.truncate(path, cut)
        time.sleep(0.001)
        with open(path, "r+b") as f:
            f.seek(cut)
            f.write(orig[cut:])
        time.sleep(0.002)
else:  # the file stays open for writing
    fd = os.open(path, os.O_RDWR)
    while time.monotonic() < end:
        os.ftruncate(fd, cut)
        time.sleep(0.001)
        os.pwrite(fd, orig[cut:], cut)
        time.sleep(0.002)
"""


@compiled
@linux
@pytest.mark.parametrize("mode", ["open", "fd"])
def test_a_file_truncated_in_a_loop_under_reads_is_never_a_signal(tmp_path: Path, mode: str) -> None:
    """Warm random and block batches by offset, batches through liblmdb and label tables read anew, while another
    process truncates the file and writes it back in a loop: one-line errors, never a signal."""
    x, y = make_data(9000, seed=31)
    path = build_store(tmp_path / "s", x, y)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "reader.py").write_text(READER)
    (tmp_path / "truncate.py").write_text(TRUNCATE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    reader = subprocess.Popen(
        [sys.executable, str(tmp_path / "reader.py"), str(path), "1.2", str(tmp_path / "x.npy")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert reader.stdout is not None and reader.stdout.readline().strip() == "READY"
    cut = subprocess.run(
        [sys.executable, str(tmp_path / "truncate.py"), str(path / "data.mdb"), "0.8", mode], timeout=120, check=False
    )
    out, err = reader.communicate(timeout=120)
    assert cut.returncode == 0
    assert reader.returncode == 0, (reader.returncode, err[-2000:])  # -7 was SIGBUS
    stats = json.loads(out.strip().splitlines()[-1])
    assert set(stats) <= {"ok", "CorruptStoreError"}, stats
    assert stats.get("CorruptStoreError", 0) > 0, stats  # it did read while the file was short


@compiled
@linux
def test_a_liblmdb_read_of_a_page_past_the_end_is_refused_and_the_reader_goes_on(tmp_path: Path) -> None:
    """The file shrinks inside a guarded liblmdb call (in this process, deterministically): the call reads zeros
    instead of dying of SIGBUS and is refused in one line; the file restored, the next read opens a new snapshot and
    reads the samples."""
    from lmdbstore.errors import CorruptStoreError
    from lmdbstore.format.layout import DB_META, META_KEY

    x, y = make_data(3000, seed=33)
    path = build_store(tmp_path / "s", x, y)
    data = path / "data.mdb"
    whole = data.read_bytes()
    with StoreReader(path) as r:
        h = r._handle()
        with pytest.raises(CorruptStoreError, match=r"shrank|truncated") as exc, h.lmdb():
            os.truncate(data, 8192)  # the meta pages only
            db = h.env.open_db(DB_META, txn=h.txn, create=False)
            bytes(h.txn.get(META_KEY, db=db))
        assert "\n" not in str(exc.value) and h.poisoned
        with open(data, "r+b") as f:
            f.write(whole)
        assert r.read_batch(np.arange(0, 3000, 7)).tobytes() == x[::7].tobytes()
        assert r._handle() is not h
        np.testing.assert_array_equal(r.labels(), y)
