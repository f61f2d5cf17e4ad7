"""The reader: batched random reads, pickling, fork safety, snapshots and checksums on real stores."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import CLASSES, StoreInfo, build_store, make_data, raw_env

from lmdbstore import (
    ChecksumError,
    CorruptStoreError,
    NotAStoreError,
    StoreNotFoundError,
    StoreReader,
    WriterConfig,
    open_reader,
)
from lmdbstore.format.layout import DB_SAMPLES, encode_key

# ----------------------------------------------------------------------------- reads


def test_read_batch_unsorted_with_repeats(small_store: StoreInfo) -> None:
    x = small_store.x
    idx = np.array([5, 3, 5, 1999, 0, 3, 18, 17, 1998, 5])
    with StoreReader(small_store.path) as r:
        np.testing.assert_array_equal(r.read_batch(idx), x[idx])
        big = np.random.default_rng(0).integers(0, 2000, 5000)  # many repeats
        np.testing.assert_array_equal(r.read_batch(big), x[big])
        np.testing.assert_array_equal(r.read_batch(idx.tolist()), x[idx])
        np.testing.assert_array_equal(r.read(1999), x[1999])
        assert r.read(7).shape == (25, 25)


def test_read_batch_into_out(small_store: StoreInfo) -> None:
    x = small_store.x
    idx = np.array([10, 2, 1500, 2])
    with StoreReader(small_store.path) as r:
        out = np.full((4, 25, 25), -1, np.float32)
        assert r.read_batch(idx, out=out) is out
        np.testing.assert_array_equal(out, x[idx])
        bads = (
            np.empty((3, 25, 25), np.float32),
            np.empty((4, 25, 25), np.float64),
            np.zeros((4, 25, 25), np.int32),  # the same item size: never its bits reinterpreted (issue 34 #10)
            np.empty((4, 625), np.float32),  # the same bytes in another shape
            np.empty((4, 25, 25), ">f4"),
        )
        for bad in bads:
            with pytest.raises(ValueError, match="out"):
                r.read_batch(idx, out=bad)
        with pytest.raises(ValueError, match="out"):
            r.read_batch(idx, out=np.empty((4, 25, 50), np.float32)[:, :, ::2])


def test_out_of_range_and_empty(small_store: StoreInfo) -> None:
    with StoreReader(small_store.path) as r:
        for bad in ([2000], [0, -1], [3, 10**12]):
            with pytest.raises(IndexError):
                r.read_batch(bad)
        with pytest.raises(IndexError):
            r.read(2000)
        with pytest.raises(IndexError):
            r.read_range(1990, 2001)
        with pytest.raises(IndexError):
            r.read_range(10, 5)
        empty = r.read_batch(np.array([], dtype=np.int64))
        assert empty.shape == (0, 25, 25) and empty.dtype == np.float32
        assert r.read_range(7, 7).shape == (0, 25, 25)
        assert r.read_range(2000, 2000).shape == (0, 25, 25)


def test_labels_and_class_index(small_store: StoreInfo) -> None:
    y = small_store.y
    with StoreReader(small_store.path) as r:
        assert r.classes == CLASSES
        np.testing.assert_array_equal(r.labels(), y)
        np.testing.assert_array_equal(r.labels_of([4, 0, 4]), y[[4, 0, 4]])
        for c in range(5):
            np.testing.assert_array_equal(r.class_indices(c), np.flatnonzero(y == c))
        for bad in (-1, 5):
            with pytest.raises(ValueError, match="class_id"):
                r.class_indices(bad)
        st = r.env_stats()
        assert st["psize"] >= 4096 and set(st["dbs"]) >= {"samples", "labels", "classidx", "progress"}
        assert st["dbs"]["samples"]["entries"] == -(-2000 // 18)


def test_missing_and_foreign_paths(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError):
        open_reader(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotAStoreError):
        open_reader(tmp_path / "f")
    with pytest.raises(NotAStoreError):
        open_reader(tmp_path)
    r = StoreReader(tmp_path / "nope")  # lazy: nothing happens until first use
    with pytest.raises(StoreNotFoundError):
        len(r)


# ----------------------------------------------------------------------------- processes


def test_pickle_carries_no_environment(small_store: StoreInfo) -> None:
    r = open_reader(small_store.path, verify_checksums=True)
    r.read(3)
    blob = pickle.dumps(r)
    assert len(blob) < 1000  # path and options only: no samples, no labels, no environment
    assert b"Environment" not in blob and b"Transaction" not in blob
    r2 = pickle.loads(blob)
    assert r2._h is None and r2.verify_checksums and r2.path == small_store.path
    r.close()  # one environment per process: the copy opens its own on first use
    np.testing.assert_array_equal(r2.read_batch([1, 0]), small_store.x[[1, 0]])
    r2.close()


def _child_read(reader: StoreReader, idx: np.ndarray, conn: Any) -> None:
    try:
        data = reader.read_batch(idx)
        assert reader._h is not None
        conn.send(("ok", data, len(reader), os.getpid(), reader._h.pid))
    except BaseException as exc:
        conn.send(("error", repr(exc), 0, 0, 0))
    finally:
        conn.close()


@pytest.mark.parametrize(("lock", "extra_ref"), [(False, False), (False, True), (True, False)])
def test_reader_reopens_after_fork(small_store: StoreInfo, lock: bool, extra_ref: bool) -> None:
    x = small_store.x
    ctx = mp.get_context("fork")
    r = StoreReader(small_store.path, lock=lock)
    np.testing.assert_array_equal(r.read(0), x[0])  # the parent holds an open environment
    parent_handle = id(r._h)
    # A lock-free child closes its inherited copy, so other references to it do not matter; a locked
    # one may only drop it (closing would free the parent's reader slot), so none may remain.
    keep = [r._h] if extra_ref else []
    idx = np.array([1999, 7, 7, 300])
    here, there = ctx.Pipe()
    p = ctx.Process(target=_child_read, args=(r, idx, there))
    p.start()
    status, data, n, child_pid, handle_pid = here.recv()
    p.join(30)
    assert p.exitcode == 0
    assert status == "ok", data
    np.testing.assert_array_equal(data, x[idx])
    assert n == 2000
    assert handle_pid == child_pid != os.getpid()  # the child opened its own environment
    # the parent's environment and snapshot are untouched by the child's exit
    assert id(r._h) == parent_handle
    if lock:
        assert str(os.getpid()) in r._h.env.readers()  # the child did not free our reader slot
    np.testing.assert_array_equal(r.read_batch(idx), x[idx])
    keep.clear()
    r.close()


_APPEND_SCRIPT = """
import sys
import numpy as np
from lmdbstore import open_writer
x = np.load(sys.argv[2])
with open_writer(sys.argv[1]) as w:
    w.append(x, 4)
"""


def test_locked_reader_keeps_its_snapshot_until_refresh(small_store: StoreInfo, tmp_path: Path) -> None:
    more, _ = make_data(50, seed=99)
    np.save(tmp_path / "more.npy", more)
    r = StoreReader(small_store.path, lock=True)
    assert len(r) == 2000
    labels_before = r.labels().copy()
    # py-lmdb allows one environment per store per process, so the writer runs in another process
    subprocess.run(
        [sys.executable, "-c", _APPEND_SCRIPT, str(small_store.path), str(tmp_path / "more.npy")],
        check=True,
        timeout=120,
    )
    assert len(r) == 2000  # still the snapshot taken when the reader opened
    np.testing.assert_array_equal(r.read_range(1990, 2000), small_store.x[1990:])
    np.testing.assert_array_equal(r.labels(), labels_before)
    with pytest.raises(IndexError):
        r.read(2000)
    r.refresh()
    assert len(r) == 2050
    np.testing.assert_array_equal(r.read_range(1995, 2050), np.concatenate([small_store.x[1995:], more]))
    assert r.labels()[2000:].tolist() == [4] * 50
    np.testing.assert_array_equal(r.class_indices(4)[-50:], np.arange(2000, 2050))
    r.close()


# ----------------------------------------------------------------------------- damage


def _damage(path: Path, first: int, how: str) -> None:
    with raw_env(path) as env, env.begin(write=True) as txn:
        db = env.open_db(DB_SAMPLES, txn=txn, create=False)
        key = encode_key(first)
        value = bytearray(txn.get(key, db=db))
        if how == "flip":
            value[10] ^= 0x01
        elif how == "flip-trailer":
            value[-1] ^= 0x80
        elif how == "truncate":
            value = value[:-100]
        if how == "delete":
            txn.delete(key, db=db)
        else:
            txn.put(key, bytes(value), db=db)


@pytest.mark.parametrize("checksum", ["crc32", "xxh64"])
@pytest.mark.parametrize("how", ["flip", "flip-trailer"])
def test_checksum_catches_a_flipped_byte(tmp_path: Path, checksum: str, how: str) -> None:
    x, y = make_data(100, seed=30)
    path = build_store(tmp_path / "s", x, y, config=WriterConfig(checksum=checksum, sync=False))
    _damage(path, 18, how)
    with StoreReader(path, verify_checksums=True) as r:
        np.testing.assert_array_equal(r.read_batch([0, 17, 36, 99]), x[[0, 17, 36, 99]])  # other values are fine
        for read in (lambda: r.read(20), lambda: r.read_batch([50, 35, 0]), lambda: r.read_range(0, 100)):
            with pytest.raises(ChecksumError) as exc:
                read()
            assert exc.value.key == 18 and "\n" not in str(exc.value)
    with StoreReader(path, check_whole_values=True) as r:  # asked to check the values it reads whole
        with pytest.raises(ChecksumError) as exc:
            r.read_range(18, 36)
        assert exc.value.key == 18
        got = r.read_batch([18, 20])  # samples, not whole values, are not checked (random order)
        if how == "flip":
            assert got[0].tobytes() != x[18].tobytes()
        else:
            np.testing.assert_array_equal(got, x[[18, 20]])
    with StoreReader(path) as r:  # by default (the check costs ~40 % of block reads), nothing notices
        got = r.read_range(18, 36)
        if how == "flip":
            assert got.tobytes() != x[18:36].tobytes()
        else:
            np.testing.assert_array_equal(got, x[18:36])


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_short_or_missing_value_is_corruption(small_store: StoreInfo, verify: bool, how: str) -> None:
    """A short value fails the reads that touch it; a missing key contradicts the count of values, which every read
    refuses (``verify_checksums`` reads through liblmdb locate their values first too: issue 34 #1)."""
    _damage(small_store.path, 36, how)
    with StoreReader(small_store.path, verify_checksums=verify) as r:
        if how == "delete":
            with pytest.raises(CorruptStoreError, match="holds 111 values; a count of 2000 means 112") as exc:
                r.read_batch([0, 35, 54])
            assert "lmdbstore verify" in str(exc.value)
            return
        r.read_batch([0, 35, 54])
        for read in (lambda: r.read(40), lambda: r.read_batch([1, 40, 2]), lambda: r.read_range(30, 60)):
            with pytest.raises(CorruptStoreError) as exc:
                read()
            assert exc.value.key == 36


def test_read_batch_copies_runs_across_value_boundaries(small_store: StoreInfo) -> None:
    """Runs of consecutive indices (block-mode batches) are copied per run; results stay exact."""
    x = small_store.x
    cases = [
        np.arange(10, 90),  # several whole and partial values, sorted
        np.r_[np.arange(30, 50), np.arange(5, 12), np.arange(1990, 2000)],  # runs in unsorted order
        np.r_[np.arange(100, 110), np.arange(100, 110)],  # a run repeated
        np.arange(1999, 1979, -1),  # descending: rows reversed
    ]
    with StoreReader(small_store.path) as r:
        for idx in cases:
            np.testing.assert_array_equal(r.read_batch(idx), x[idx])


def test_a_worker_error_rewrapped_by_torch_keeps_its_one_line() -> None:
    from lmdbstore.errors import CorruptStoreError

    wrapped = (
        "Caught CorruptStoreError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n    raise X\nlmdbstore.errors.CorruptStoreError: /s: value missing (at 72)\n'
    )
    assert str(CorruptStoreError(wrapped)) == "/s: value missing (at 72)"
    assert str(CorruptStoreError("plain", path="/s")) == "/s: plain"


def test_read_errors_of_the_data_file_become_store_errors(small_store) -> None:  # type: ignore[no-untyped-def]
    from lmdbstore import CorruptStoreError, StoreReader

    r = StoreReader(small_store.path).open()
    try:
        assert r.read_path == "positions"
        h = r._handle()
        assert h.files is not None
        h.files.fd = -1  # every read by file offset now fails in the OS (EBADF), as a failing disk would
        with pytest.raises(CorruptStoreError, match="I/O error") as info:
            r.read_batch(np.arange(0, 2000, 7))
        assert str(small_store.path) in str(info.value)
    finally:
        r.close()
