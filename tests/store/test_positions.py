"""Reads by file offset (lmdbstore.format.pages, lmdbstore.store.positions) against the liblmdb path, bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CLASSES, TESTS, StoreInfo, build_store, make_data

from lmdbstore import WriterConfig, open_writer
from lmdbstore.errors import CorruptStoreError
from lmdbstore.format import pages as pages_mod
from lmdbstore.format.btree import main_db_entry
from lmdbstore.format.layout import DB_SAMPLES
from lmdbstore.format.pages import PageReader, read_meta_page
from lmdbstore.store.reader import StoreReader


def both_paths_agree(path: Path, x: np.ndarray, seed: int = 0) -> None:
    """Random, sorted, repeated and range reads give the written samples on both read paths."""
    n = len(x)
    fast, slow = StoreReader(path), StoreReader(path, positions=False)
    try:
        assert fast.read_path == "positions" and slow.read_path == "lmdb"
        rng = np.random.default_rng(seed)
        batches = [rng.integers(0, n, min(n, 300)), np.sort(rng.integers(0, n, min(n, 300))), np.arange(n)]
        batches.append(np.r_[n - 1, 0, n - 1, n // 2])
        for b in batches:
            got = fast.read_batch(b)
            assert got.tobytes() == x[b].tobytes()
            assert got.tobytes() == slow.read_batch(b).tobytes()
        lo = n // 3
        assert fast.read_range(lo, n).tobytes() == x[lo:].tobytes()
    finally:
        fast.close()
        slow.close()


@pytest.mark.parametrize(
    ("n", "shape", "dtype", "spv", "checksum"),
    [
        (1, (25, 25), np.float32, None, "crc32"),  # one partial value
        (17, (25, 25), np.float32, None, "crc32"),
        (18, (25, 25), np.float32, None, "crc32"),  # exactly one full value
        (1001, (25, 25), np.float32, None, "crc32"),  # last value partial
        (500, (3, 7), np.float64, 5, "none"),  # small inline values
        (300, (8,), np.uint8, 1, "crc32"),  # one tiny value per sample
        (40, (100, 100), np.float32, 1, "crc32"),  # 40 KB samples, one per value
        (700, (4, 4, 4), np.int16, 7, "none"),
        (257, (2, 3), np.uint64, 3, "crc32"),
    ],
)
def test_positions_equal_lmdb_on_many_layouts(
    tmp_path: Path, n: int, shape: tuple[int, ...], dtype: Any, spv: int | None, checksum: str
) -> None:
    x, y = make_data(n, seed=n, shape=shape, dtype=dtype)
    cfg = WriterConfig(samples_per_value=spv, checksum=checksum, sync=False)  # type: ignore[arg-type]
    path = build_store(tmp_path / "s", x, y, config=cfg, batch=max(1, n // 3))
    both_paths_agree(path, x)


def test_deep_btree(tmp_path: Path) -> None:
    """60k one-byte values: a B-tree of depth 3 (branch pages over branch pages)."""
    x, y = make_data(60_000, seed=3, shape=(1,), dtype=np.uint8)
    path = build_store(tmp_path / "s", x, y, config=WriterConfig(samples_per_value=1, checksum="none", sync=False))
    with StoreReader(path) as r:
        assert r.env_stats()["dbs"]["samples"]["depth"] >= 3
    both_paths_agree(path, x)


def test_appends_after_reopen_rewrite_the_last_value(tmp_path: Path) -> None:
    x, y = make_data(1000, seed=5)
    path = build_store(tmp_path / "s", x[:500], y[:500], config=WriterConfig(sync=False))  # 500 = 27*18 + 14
    both_paths_agree(path, x[:500])
    for lo, hi in ((500, 503), (503, 1000)):
        with open_writer(path, config=WriterConfig(sync=False)) as w:
            w.append(x[lo:hi], y[lo:hi])
        both_paths_agree(path, x[:hi])


def test_store_resumed_after_a_kill(tmp_path: Path) -> None:
    path = tmp_path / "s"
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(TESTS)!r})
        from conftest import make_data
        from lmdbstore import open_writer, WriterConfig
        x, y = make_data(3000, seed=9)
        w = open_writer({str(path)!r}, shape=(25, 25), dtype="float32", classes={CLASSES!r},
                        config=WriterConfig(sync=False))
        for lo in range(0, 3000, 250):
            w.append(x[lo:lo + 250], y[lo:lo + 250])
            w.commit()
            if lo == 1000:
                print("committed", flush=True)
                os.kill(os.getpid(), {int(signal.SIGKILL)})
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGKILL and "committed" in res.stdout
    x, y = make_data(3000, seed=9)
    with StoreReader(path) as r:
        done = len(r)
    assert done == 1250
    both_paths_agree(path, x[:done])
    with open_writer(path, config=WriterConfig(sync=False)) as w:
        w.append(x[done:], y[done:])
    both_paths_agree(path, x)


# ----------------------------------------------------------------------------- fallback


def test_unknown_layout_falls_back_to_lmdb(small_store: StoreInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pages_mod, "DATA_VERSION_09", 99)  # as if the file were another LMDB data version
    with StoreReader(small_store.path) as r:
        assert r.read_path == "lmdb"
        idx = np.array([1999, 0, 18, 17, 17])
        np.testing.assert_array_equal(r.read_batch(idx), small_store.x[idx])


def test_positions_off_by_request(small_store: StoreInfo) -> None:
    with StoreReader(small_store.path, positions=False) as r:
        assert r.read_path == "lmdb"
        assert r._handle().table is None


def test_snapshot_whose_meta_page_was_reused_still_reads_by_offset(small_store: StoreInfo) -> None:
    """A lock=True reader opened, then a writer (another process) committed three times: its snapshot's
    meta page is gone from the file, but the reader kept it when its transaction began, and the pages it
    names are the registered snapshot's: the table is built for it and reads its own snapshot."""
    path, x = small_store.path, small_store.x
    r = StoreReader(path, lock=True)
    assert len(r) == 2000  # snapshot taken; no read yet, so no table yet
    _append_in_child(path, 2000, 2100, commits=3)
    assert r.read_path == "positions" and len(r) == 2000
    np.testing.assert_array_equal(r.read_batch(np.arange(2000)), x)
    r.close()


def _append_in_child(path: Path, lo: int, hi: int, commits: int) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import numpy as np
        from lmdbstore import open_writer, WriterConfig
        x = np.full(({hi - lo}, 25, 25), -7.0, np.float32)
        with open_writer({str(path)!r}, config=WriterConfig(sync=False)) as w:
            for part in np.array_split(np.arange({hi - lo}), {commits}):
                w.append(x[part], 0)
                w.commit()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_lock_reader_snapshot_intact_while_a_writer_appends(small_store: StoreInfo) -> None:
    path, x = small_store.path, small_store.x
    r = StoreReader(path, lock=True)
    assert r.read_path == "positions"
    _append_in_child(path, 2000, 2500, commits=1)  # rewrites the partial last value, adds new ones
    assert len(r) == 2000
    np.testing.assert_array_equal(r.read_batch(np.arange(2000)), x)
    r.refresh()
    assert len(r) == 2500 and r.read_path == "positions"
    got = r.read_batch(np.arange(1990, 2500))
    np.testing.assert_array_equal(got[:10], x[1990:])
    assert (got[10:] == -7.0).all()
    r.close()


# ----------------------------------------------------------------------------- damage


def _samples_root(path: Path) -> tuple[int, int]:
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        metas = [read_meta_page(fd, size, i) for i in (0, 1)]
        meta = max(metas, key=lambda m: m.txnid)
        db = main_db_entry(PageReader(fd, size, meta, None, None), meta.main, DB_SAMPLES)
        return db.root, meta.psize
    finally:
        os.close(fd)


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage", ["page-number", "bounds", "overflow-pointer"])
def test_damaged_pages_give_corrupt_store_error(small_store: StoreInfo, damage: str) -> None:
    path = small_store.path
    with StoreReader(path) as r:
        assert r.env_stats()["dbs"]["samples"]["depth"] == 1  # the root is the only leaf
    root, psize = _samples_root(path)
    page = root * psize
    if damage == "page-number":
        _poke(path, page, struct.pack("<Q", root + 1))
    elif damage == "bounds":
        _poke(path, page + 12, struct.pack("<HH", 4000, 100))  # lower > upper
    else:
        with open(path / "data.mdb", "rb") as f:
            f.seek(page + 16)
            first_node = struct.unpack("<H", f.read(2))[0]
        _poke(path, page + first_node + 16, struct.pack("<Q", 1 << 40))  # overflow page far past the end
    with StoreReader(path) as r, pytest.raises(CorruptStoreError) as exc:
        r.read_batch([5, 100])
    assert "\n" not in str(exc.value)


def test_truncated_after_open_gives_corrupt_store_error(small_store: StoreInfo) -> None:
    path = small_store.path
    r = StoreReader(path)
    assert r.read_path == "positions"
    size = os.path.getsize(path / "data.mdb")
    os.truncate(path / "data.mdb", size // 2)
    try:
        for batch in (np.arange(1900, 2000), np.arange(1800, 2000)[::-1]):
            with pytest.raises(CorruptStoreError):
                r.read_batch(batch)
    finally:
        r.close()


# ----------------------------------------------------------------------------- processes


def _child_table(reader: StoreReader, conn: Any) -> None:
    try:
        got = reader.read_batch(np.array([1999, 3, 500]))
        h = reader._handle()
        conn.send(("ok", got, h.table_source, h.pid == os.getpid()))
    except BaseException as exc:
        conn.send(("error", repr(exc), "", False))
    finally:
        conn.close()


@pytest.mark.parametrize(("method", "source"), [("fork", "inherited"), ("spawn", "built"), ("forkserver", "built")])
@pytest.mark.parametrize("lock", [False, True])
def test_workers_inherit_or_build_the_table(small_store: StoreInfo, method: str, source: str, lock: bool) -> None:
    r = StoreReader(small_store.path, lock=lock)
    assert r.read_path == "positions"
    ctx = mp.get_context(method)
    here, there = ctx.Pipe()
    p = ctx.Process(target=_child_table, args=(r, there))
    p.start()
    status, data, got_source, own = here.recv()
    p.join(60)
    assert status == "ok", data
    np.testing.assert_array_equal(data, small_store.x[[1999, 3, 500]])
    assert own and got_source == source
    np.testing.assert_array_equal(r.read_batch([0, 1]), small_store.x[[0, 1]])
    r.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_by_offset(small_store: StoreInfo, context: str) -> None:
    from lmdbstore import LoaderConfig
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
    from lmdbstore.loader.samplers import EpochBatchSampler

    ds = LmdbBatchDataset(small_store.path)
    sampler = EpochBatchSampler(np.arange(2000), 256, shuffle="random", seed=3)
    workers = 2 if context == "fork" else 1  # a spawned reader starts an interpreter and imports torch: one proves it
    cfg = LoaderConfig(batch_size=256, workers=workers, multiprocessing_context=context, persistent_workers=False)
    seen = []
    for (xb, yb), idx in zip(make_loader(ds, sampler, cfg), sampler.batches(), strict=True):
        np.testing.assert_array_equal(xb[:, 0].numpy(), small_store.x[idx])
        np.testing.assert_array_equal(yb.numpy(), small_store.y[idx])
        seen.append(idx)
    assert sorted(np.concatenate(seen).tolist()) == list(range(2000))


def test_prefetch_ranges_cover_exactly_the_values_of_the_ranges(tmp_path: Path) -> None:
    """The read-ahead of sample ranges (the window order's next window) covers every byte of each value in them and
    little else, on a store whose leaves were rewritten away from their values by many commits."""
    from lmdbstore.store.positions import prefetch_ranges

    x, y = make_data(20_000, seed=7, shape=(10, 10))
    path = build_store(tmp_path / "s", x, y, config=WriterConfig(sync=False), batch=700)
    with StoreReader(path) as truth, StoreReader(path) as r:

        def located(h: Any) -> np.ndarray:
            t = truth._positions(h)
            t.ensure(np.arange(len(t.offsets)), h.files)
            return t.offsets.copy()

        offsets = truth._guarded("read", located)
        spv = r.meta.samples_per_value
        lo, hi = np.array([0, 3_001, 9_990, 19_000]), np.array([1_500, 3_002, 12_345, 20_000])

        def ranges(h: Any) -> tuple[list[int], list[int], int]:
            t = r._positions(h)
            return (*prefetch_ranges(t, lo, hi, h.files), t.layout[4])

        starts, ends, vlen = r._guarded("read", ranges)
    values = np.unique(np.concatenate([np.arange(a // spv, (b - 1) // spv + 1) for a, b in zip(lo, hi, strict=True)]))
    assert (offsets[values] >= 0).all()
    for v in values.tolist():  # every byte of each value lies in one range
        i = np.searchsorted(starts, offsets[v], side="right") - 1
        assert i >= 0 and offsets[v] + vlen <= ends[i], v
    assert (
        sum(e - s for s, e in zip(starts, ends, strict=True)) <= len(values) * vlen + len(starts) * 4096
    )  # and little else
