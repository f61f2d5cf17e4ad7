"""The compiled copier and its fallback (lmdbstore.store.copies, lmdbstore/store/fastcopy.c; issue 27).

Every read path is run twice, with the compiled copier and with the pure-Python fallback (numpy gathers under
a read lease, ``process_vm_readv`` without one), and compared with the samples written and with liblmdb's
bytes: every sample size (tiny ones many to a page, odd ones, ones larger than a page), random, block and
window batches, with and without ``out``, warm, cold and half-cached, a set of stores, and the file held open
for writing (no lease).  The copier's own checks: ranges outside the map or the output are refused before
anything is copied, and a page past the end of a shrunk file is ``SOURCE`` (a destination's: ``DEST``), never SIGBUS.
"""

from __future__ import annotations

import contextlib
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
from conftest import StoreInfo, build_store, make_data

from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.window import WindowBatchSampler
from lmdbstore.store import copies
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.residency import Residency

compiled = pytest.mark.skipif(copies.FAST is None, reason="the compiled copier was not built here")


@pytest.fixture(params=["compiled", "fallback"])
def copier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test twice: with the compiled copier (where it was built) and with the fallback."""
    if request.param == "compiled":
        if copies.FAST is None:
            pytest.skip("the compiled copier was not built here")
    else:
        monkeypatch.setattr(copies, "FAST", None)
    yield request.param


def drop(path: Path, r: StoreReader | None = None) -> None:
    """Drop the data file's pages from the page cache (the reader's map lets go of them first)."""
    if r is not None and r._h is not None and r._h.engine is not None:
        e = r._h.engine
        if e._map is not None:
            e._map.madvise(mmap.MADV_DONTNEED)
        if e._res is not None:
            e.residency().distrust()
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(3):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            time.sleep(0.02)
    finally:
        os.close(fd)


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
    copier: str, store_factory: Any, shape: tuple[int, ...], dtype: Any
) -> None:
    info = store_factory(150 if np.prod(shape) > 4096 else 700, seed=8, shape=shape, dtype=dtype)  # 10 MB at most
    rng = np.random.default_rng(4)
    with StoreReader(info.path) as r, StoreReader(info.path, positions=False) as ref:
        spv = r.meta.samples_per_value
        bs = batches(info, rng, spv)
        for b in bs:  # liblmdb's bytes are the written ones
            assert ref.read_batch(b).tobytes() == info.x[b].tobytes()
        read_all_ways(r, info, bs)  # cold headers, then warm
        read_all_ways(r, info, bs)
        drop(info.path, r)
        read_all_ways(r, info, bs)  # cold pages, headers checked
        drop(info.path, r)
        r.read_batch(np.arange(0, len(info.x), 3))  # a third of the samples cached again
        read_all_ways(r, info, bs)
        engine = r._handle().engine
        assert engine is not None and (engine.fast is not None) == (copier == "compiled")


def test_a_set_reads_exactly_grouped_or_not(copier: str, tmp_path: Path) -> None:
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


def test_without_a_lease_the_copies_are_exact(copier: str, small_store: StoreInfo) -> None:
    """A writer holding data.mdb open for writing leaves no lease to take: the copies go through the compiled
    copier (SIGBUS caught) or the kernel, exactly."""
    info = small_store
    rng = np.random.default_rng(6)
    with StoreReader(info.path) as r:
        r.read_batch(np.arange(len(info.x)))  # every header checked, every page cached
        fd = os.open(info.path / "data.mdb", os.O_RDWR)
        try:
            h = r._handle()
            with h.guard.hold(0) as leased:
                assert not leased
            read_all_ways(r, info, batches(info, rng, r.meta.samples_per_value))
        finally:
            os.close(fd)


def _build(path: Path) -> None:
    build_store(path, *make_data(2000, seed=1234))


def built_elsewhere(path: Path) -> np.ndarray:
    """Build a store of 2,000 samples in a child process (no page of it mapped in this one); its samples."""
    p = mp.get_context("fork").Process(target=_build, args=(path,))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    return make_data(2000, seed=1234)[0]


def cached(path: Path, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Whether each byte run of the data file is in the page cache, asked through a map of this test's own."""
    with open(path / "data.mdb", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        arr = np.frombuffer(m, np.uint8)
        got = Residency(arr.ctypes.data, len(m)).cached(offs, lens)
        del arr
    return got


@contextlib.contextmanager
def cold_reader(path: Path) -> Iterator[tuple[StoreReader, np.ndarray, Any, Any]]:
    """A reader of a store built at ``path`` by another process, its table made, its pages dropped: the
    reader, the samples written, its pread engine and its position table."""
    x = built_elsewhere(path)
    with StoreReader(path) as r:
        r.read_batch(np.arange(2000))
        drop(path, r)
        e, table = r._handle().engine, r._table
        assert e is not None and table is not None
        yield r, x, e, table


def gone_values(path: Path, offsets: np.ndarray, k: int = 3) -> np.ndarray:
    """``k`` whole values (of 18 samples of 2,500 bytes) none of whose pages is in the page cache (skip if
    fewer: fadvise DONTNEED keeps the pages a map of this process still holds)."""
    every = np.arange(len(offsets) - 1)
    pages = (offsets[every] - 16)[:, None] + np.arange(0, 18 * 2500 + 16, 4096)[None, :]
    gone = every[~cached(path, pages.ravel(), np.ones(pages.size, np.int64)).reshape(pages.shape).any(axis=1)]
    if len(gone) < k:
        pytest.skip("this file system keeps the pages cached (fadvise DONTNEED has no effect)")
    return gone[:: max(1, len(gone) // k)][:k]


@pytest.mark.parametrize("headers", ["checked", "first read"])
def test_a_cold_piece_of_a_value_brings_the_rest_of_it(copier: str, headers: str, tmp_path: Path) -> None:
    """Block order reads a value in pieces over several batches: the first piece read from the disk reads the
    whole value (from the overflow header on where the header is checked in the same read), so the next piece
    is a copy from the page cache, not a second disk read."""
    path = tmp_path / "s"
    with cold_reader(path) as (r, x, e, table):
        values = gone_values(path, table.offsets)
        if headers == "first read":
            table.checked[values] = False  # as in a process that has not read these values yet
        middle = table.offsets[values] + 5 * 2500
        first = np.concatenate([np.arange(v * 18 + 5, v * 18 + 11) for v in values.tolist()])  # samples 5..10
        rest = np.concatenate([np.r_[v * 18 : v * 18 + 5, v * 18 + 11 : v * 18 + 18] for v in values.tolist()])
        e.stats = dict.fromkeys(e.stats, 0)
        assert r.read_batch(first).tobytes() == x[first].tobytes()
        assert e.stats["pread_runs"] >= 1  # (the kernel's read-ahead may have brought a neighbour along)
        assert table.checked[values].all()
        heads, tails = table.offsets[values] - 16, middle + 6 * 2500
        assert cached(path, heads, np.full(3, 5 * 2500 + 16)).all()  # read along: the value before the piece
        assert cached(path, tails, table.offsets[values] + 18 * 2500 - tails).all()  # and after it
        e.stats = dict.fromkeys(e.stats, 0)
        assert r.read_batch(rest).tobytes() == x[rest].tobytes()
        assert e.stats["pread_runs"] == 0 and e.stats["copied_runs"] > 0  # not a second disk read


def test_a_short_cold_run_is_not_read_along(copier: str, tmp_path: Path) -> None:
    """Random order (runs shorter than EXTEND_RUN_SAMPLES) reads only the samples asked for: the junk a read
    along is thrown into is at most one value, and none is read for short runs."""
    path = tmp_path / "s"
    with cold_reader(path) as (r, x, e, table):
        v = gone_values(path, table.offsets, 4) * 18
        sizes: list[int] = []
        real = e._submit

        def submit(bufs_of: Any, offs: list[int], want: list[int]) -> Any:
            sizes.extend(want)
            return real(bufs_of, offs, want)

        e._submit = submit  # type: ignore[method-assign]
        idx = np.concatenate([v[:1], v[1:2] + 7, v[1:2] + 8, v[2:3] + 17, v[2:3] + 3])  # runs of 1 and 2 samples
        assert r.read_batch(idx).tobytes() == x[idx].tobytes()
        assert len(sizes) == 4 and max(sizes) <= 2 * 2500
        sizes.clear()
        idx = np.arange(v[3] + 2, v[3] + 12)  # one run of 10 in a value of 18 (another value)
        assert r.read_batch(idx).tobytes() == x[idx].tobytes()
        assert sizes == [18 * 2500]  # the whole value, not more


@compiled
def test_the_copier_refuses_ranges_outside_the_map_or_the_output() -> None:
    fast = copies.FAST
    assert fast is not None
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    at, base = np.array([0, 32], np.int64), src.ctypes.data
    assert fast.copy(dst, at, base, 256, np.array([10, 200], np.int64), 32) == copies.COPIED
    assert dst[:32].tolist() == list(range(10, 42)) and dst[32:].tolist() == list(range(200, 232))
    lens = np.array([5, 7], np.int64)
    assert fast.copy(dst, at, base, 256, np.array([1, 2], np.int64), lens) == copies.COPIED
    assert dst[:5].tolist() == [1, 2, 3, 4, 5] and dst[32:39].tolist() == list(range(2, 9))
    before = dst.copy()
    for offs, width, where in (([0, 250], 32, "map"), ([0, -1], 4, "map"), ([0, 0], 40, "dst")):
        with pytest.raises(ValueError, match="outside the map or dst"):
            fast.copy(dst, at, base, 256, np.array(offs, np.int64), width)
        assert dst.tobytes() == before.tobytes(), where  # nothing copied
    with pytest.raises(ValueError, match="same length"):
        fast.copy(dst, at, base, 256, np.array([0], np.int64), 4)
    with pytest.raises(TypeError, match="int64"):
        fast.copy(dst, at.astype(np.int32), base, 256, np.array([0, 0], np.int64), 4)
    with pytest.raises((TypeError, BufferError, ValueError)):
        fast.copy(np.zeros(64, np.uint8)[::2], at, base, 256, np.array([0, 0], np.int64), 4)


_SHRINK = """
import faulthandler, mmap, os, sys
import numpy as np
from lmdbstore.store import copies
fast = copies.FAST
assert fast is not None
f, g = sys.argv[1], sys.argv[2]
with open(f, "wb") as fh:
    fh.write(bytes(range(256)) * 64)  # 4 pages
fd = os.open(f, os.O_RDONLY)
m = mmap.mmap(fd, 16384, prot=mmap.PROT_READ)
base = np.frombuffer(m, np.uint8).ctypes.data
out = np.zeros(300, np.uint8)
at, offs, lens = np.array([0, 100], np.int64), np.array([5, 9000], np.int64), np.array([100, 200], np.int64)
assert fast.copy(out, at, base, 16384, offs, lens) == copies.COPIED
assert out[100:300].tolist() == [(9000 + i) % 256 for i in range(200)]
os.truncate(f, 4096)  # pages 1 to 3 gone: touching them is SIGBUS
with open(g, "wb") as fh:
    fh.write(bytes(8192))
gd = os.open(g, os.O_RDWR)
gm = mmap.mmap(gd, 8192)  # a destination that maps a file...
far = np.frombuffer(gm, np.uint8)
os.ftruncate(gd, 0)  # ...truncated: writing it is SIGBUS
for handler in (False, True):  # with faulthandler's SIGBUS handler installed before the copies, too
    if handler:
        faulthandler.enable()
    assert fast.copy(out, at, base, 16384, offs, lens) == copies.SOURCE
    assert fast.copy(out, at[:1], base, 16384, offs[:1], 100) == copies.COPIED  # page 0 is still there
    assert out[:100].tolist() == [(5 + i) % 256 for i in range(100)]
    assert fast.copy(far, at[:1], base, 16384, offs[:1], 100) == copies.DEST  # the destination's page, not the map's
print("survived")
"""


@compiled
def test_a_copy_of_pages_past_the_end_of_a_shrunk_file_is_told_not_sigbus(tmp_path: Path) -> None:
    """In a child process: were SIGBUS not caught, it would kill the child, not this test run."""
    p = subprocess.run(
        [sys.executable, "-c", _SHRINK, str(tmp_path / "f"), str(tmp_path / "g")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0 and p.stdout.strip() == "survived", (p.returncode, p.stderr[-2000:])


def test_the_fallback_is_chosen_by_the_environment_and_reads_exactly(tmp_path: Path) -> None:
    """``LMDBSTORE_FASTCOPY=0`` (read at import) turns the compiled copier off in a process; reads are exact."""
    x = built_elsewhere(tmp_path / "s")
    code = (
        "import sys, numpy as np\n"
        "from lmdbstore.store import copies\n"
        "from lmdbstore.store.reader import StoreReader\n"
        "with StoreReader(sys.argv[1]) as r:\n"
        "    for b in (np.arange(2000), np.random.default_rng(1).integers(0, 2000, 500)):\n"
        "        sys.stdout.buffer.write(r.read_batch(b).tobytes())\n"
        "    assert (r._handle().engine.fast is None) == (copies.FAST is None)\n"
        "sys.stderr.write('compiled' if copies.compiled() else 'fallback')\n"
    )
    for switch, want in (("0", "fallback"), ("1", "compiled" if copies.FAST is not None else "fallback")):
        env = {**os.environ, copies.ENV_SWITCH: switch}
        p = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, env=env, timeout=120, check=False
        )
        assert p.returncode == 0, p.stderr.decode()[-2000:]
        assert p.stderr.decode().strip().endswith(want)
        b = np.random.default_rng(1).integers(0, 2000, 500)
        assert p.stdout == x.tobytes() + x[b].tobytes()


@compiled
def test_the_compiled_locate_and_page_lookup_agree_with_numpy() -> None:
    fast = copies.FAST
    assert fast is not None
    rng = np.random.default_rng(9)
    offsets = rng.integers(0, 1 << 30, 500).astype(np.int64)
    checked = np.ones(500, bool)
    idx = rng.integers(0, 500 * 18, 1000).astype(np.int64)
    out = np.empty(1000, np.int64)
    assert fast.locate(idx, offsets, checked, 18, 2500, out) == -1
    np.testing.assert_array_equal(out, offsets[idx // 18] + (idx % 18) * 2500)
    checked[idx[600] // 18] = False
    assert fast.locate(idx, offsets, checked, 18, 2500, out) == int(np.flatnonzero(~checked[idx // 18])[0])
    checked[:] = True
    offsets[idx[300] // 18] = -1
    assert fast.locate(idx, offsets, checked, 18, 2500, out) == int(np.flatnonzero(offsets[idx // 18] < 0)[0])
    with pytest.raises(IndexError):
        fast.locate(np.array([500 * 18], np.int64), offsets, checked, 18, 2500, out)
    pages = (rng.random(2000) < 0.95).astype(np.uint8)
    for width in (1, 100, 4096, 20000):
        offs = rng.integers(0, 1900 * 4096 - width, 300).astype(np.int64)
        want = all(pages[o >> 12 : ((o + width - 1) >> 12) + 1].all() for o in offs.tolist())
        assert fast.known(pages, offs, width, 12) is want
        good = offs[[pages[o >> 12 : ((o + width - 1) >> 12) + 1].all() for o in offs.tolist()]]
        assert fast.known(pages, good, width, 12) is True
