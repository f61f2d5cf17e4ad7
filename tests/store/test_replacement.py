"""A store replaced, grown or compacted under an open reader, set, feed or DataLoader: every batch is the store's
own samples with their own labels, or a one-line StoreReplacedError -- never another store's samples under the
old labels, never a healthy store reported corrupt (issue 25).

The matrix: (in-place ``cp`` of another store written the same way, ``rm -r`` and ``copy --compact``, a data
file renamed over, an append, a compacted copy renamed into place) x (lock-free reader, ``lock=True`` reader, a
set, a feed with a reader process, DataLoader workers) x (replaced before the first read, mid-epoch).  The
stores are small (540 samples) and copied from module-wide originals, so a case costs a file copy.
"""

from __future__ import annotations

import os
import shutil
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_data

from lmdbstore import open_writer
from lmdbstore.errors import LmdbStoreError, StoreReplacedError
from lmdbstore.format.pages import META_BYTES
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.registry import ENVS
from lmdbstore.tools.copy import copy_store

N = 540  # 30 values of 18 samples
BATCH = 60


@dataclass(frozen=True)
class Originals:
    """Two stores written the same way (other samples, every label another) and a compacted copy of the first."""

    a: Path
    b: Path
    compacted: Path
    xa: np.ndarray
    ya: np.ndarray
    xb: np.ndarray
    yb: np.ndarray


def _build(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    with open_writer(path, shape=x.shape[1:], dtype=x.dtype, classes=list("abcde")) as w:
        w.append(x, y)
    return path


@pytest.fixture(scope="module")
def orig(tmp_path_factory: pytest.TempPathFactory) -> Originals:
    base = tmp_path_factory.mktemp("originals")
    xa, ya = make_data(N, seed=11)
    xb, _ = make_data(N, seed=12)
    yb = (ya + 1) % 5
    a, b = _build(base / "a", xa, ya), _build(base / "b", xb, yb)
    copy_store(a, base / "compacted", compact=True)
    with open(a / "data.mdb", "rb") as fa, open(b / "data.mdb", "rb") as fb:
        pages = [(os.pread(f.fileno(), META_BYTES, 0), os.pread(f.fileno(), META_BYTES, 4096)) for f in (fa, fb)]
    assert pages[0] == pages[1]  # the hard case: meta pages byte for byte the same
    return Originals(a, b, base / "compacted", xa, ya, xb, yb)


# ---------------------------------------------------------------------------------------------- what happens
def _cp(a: Path, o: Originals, tmp: Path) -> None:
    shutil.copyfile(o.b / "data.mdb", a / "data.mdb")  # the same inode, the other store's bytes


def _rm_copy(a: Path, o: Originals, tmp: Path) -> None:
    shutil.rmtree(a)
    copy_store(o.b, a, compact=True)  # in this process: py-lmdb may see a stale inode number again


def _rename(a: Path, o: Originals, tmp: Path) -> None:
    shutil.copytree(o.b, tmp / "other")
    os.replace(tmp / "other" / "data.mdb", a / "data.mdb")  # lock.mdb stays


def _append(a: Path, o: Originals, tmp: Path) -> None:
    x, y = make_data(100, seed=13)
    with open_writer(a) as w:  # in this process: the shared environment is re-opened writable
        w.append(x, y)


def _compact(a: Path, o: Originals, tmp: Path) -> None:
    shutil.copytree(o.compacted, tmp / "compacted")
    a.rename(tmp / "old")
    (tmp / "compacted").rename(a)


CHANGES: dict[str, Callable[[Path, Originals, Path], None]] = {
    "cp": _cp,
    "rm_copy": _rm_copy,
    "rename": _rename,
    "append": _append,
    "compact": _compact,
}


# ---------------------------------------------------------------------------------------------- who reads
def _order() -> list[np.ndarray]:
    return list(np.random.default_rng(3).permutation(N).reshape(-1, BATCH))


def _reader(a: Path, lock: bool) -> Iterator[Any]:
    r = StoreReader(a, lock=lock).open()
    r.labels()
    yield None  # opened, labels read: the "before the first read" point
    for idx in _order():
        yield r.read_batch(idx), r.labels_of(idx)
    r.close()


def _set(a: Path, o: Originals) -> Iterator[Any]:
    s = StoreSet([a, o.b]).open()
    labels = s.labels()
    yield None
    for idx in _order():  # the first store's part of the set
        yield s.read_batch(idx), labels[idx]
    s.close()


def _feed(a: Path) -> Iterator[Any]:
    from lmdbstore.feed.opening import loader_config, open_feed

    feed = open_feed(a, loader_config(None, {"batch_size": BATCH, "workers": 1, "multiprocessing_context": "fork"}))
    yield None
    try:
        feed.begin()
        while True:
            try:
                x, y = feed.next()
            except StopIteration:
                return
            yield x[..., 0].copy(), y.copy()
    finally:
        feed.close()


def _loader(a: Path) -> Iterator[Any]:
    pytest.importorskip("torch")
    from lmdbstore.config import LoaderConfig
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
    from lmdbstore.loader.samplers import EpochBatchSampler

    ds = LmdbBatchDataset(a)
    cfg = LoaderConfig(batch_size=BATCH, workers=1, prefetch=1, multiprocessing_context="fork")
    loader = make_loader(ds, EpochBatchSampler(np.arange(N), BATCH, shuffle="random", seed=0), cfg)
    yield None
    for x, y in loader:
        yield x.numpy()[:, 0].copy(), y.numpy().copy()


CONSUMERS: dict[str, Callable[[Path, Originals], Iterator[Any]]] = {
    "lock_free": lambda a, o: _reader(a, False),
    "lock_true": lambda a, o: _reader(a, True),
    "set": _set,
    "feed": lambda a, o: _feed(a),
    "loader": lambda a, o: _loader(a),
}


def _run(consumer: Iterator[Any], change: Callable[[], None], mid: bool, o: Originals) -> tuple[int, str]:
    """Samples read, and ``"ok"`` or the error; ``change()`` happens after the consumer opened (and, ``mid``,
    after its first two batches).  Every batch read must hold the first store's own samples and labels."""
    got = []
    assert next(consumer) is None  # opened: metadata, labels, split
    outcome = "ok"
    try:
        if mid:
            got += [next(consumer), next(consumer)]
        change()
        got += list(consumer)
    except LmdbStoreError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
        # the traceback's frames hold a DataLoader iterator in a cycle: a shutdown from inside the garbage
        # collector waits 5 s for its worker (torch); cleared here, it shuts down at once
        traceback.clear_frames(exc.__traceback__)
    for x, y in got:
        idx = np.rint(x.reshape(len(x), -1)[:, 0]).astype(np.int64)  # a sample's first value is its index
        np.testing.assert_array_equal(x, o.xa[idx])
        np.testing.assert_array_equal(y, o.ya[idx])
    return sum(len(x) for x, _ in got), outcome


@pytest.mark.parametrize("mid", [False, True], ids=["before_first_read", "mid_epoch"])
@pytest.mark.parametrize("who", list(CONSUMERS))
@pytest.mark.parametrize("what", list(CHANGES))
def test_replaced_grown_or_compacted_under_a_consumer(
    orig: Originals, tmp_path: Path, what: str, who: str, mid: bool
) -> None:
    a = tmp_path / "a"
    shutil.copytree(orig.a, a)
    seen, outcome = _run(CONSUMERS[who](a, orig), lambda: CHANGES[what](a, orig, tmp_path), mid, orig)
    if outcome != "ok":
        # the only error: the store was replaced, on one line (an append replaces nothing); "truncated" only
        # where a reader process read while ``cp`` was rewriting the file in place
        assert "\n" not in outcome and what != "append", outcome
        truncated = (
            what == "cp"
            and mid
            and who in ("feed", "loader")
            and (  # cp rewrites the file in place:
                "truncated while open" in outcome or "data file is truncated" in outcome  # read, or checked, mid-copy
            )
        )
        assert outcome.startswith("StoreReplacedError: ") or truncated, outcome
    else:
        assert seen == N  # the whole epoch, each sample once, each its own bytes and label
    if what == "cp" and who in ("lock_free", "lock_true", "feed", "loader"):
        assert outcome != "ok"  # another store's samples in place: nothing after the change can be read


# ---------------------------------------------------------------------------------------------- one by one
def test_a_new_reader_after_rm_and_copy_gets_the_new_store_and_old_readers_fail(
    orig: Originals, tmp_path: Path
) -> None:
    """Issue 25 #2: the registry is keyed by the path, but an entry is tied to the data file it opened."""
    a = tmp_path / "a"
    shutil.copytree(orig.a, a)
    old = StoreReader(a, lock=True)
    np.testing.assert_array_equal(old.read_batch(np.arange(N)), orig.xa)
    shutil.rmtree(a)
    copy_store(orig.b, a, compact=True)
    new = StoreReader(a)
    np.testing.assert_array_equal(new.read_batch(np.arange(N)), orig.xb)  # not the old environment
    np.testing.assert_array_equal(new.labels(), orig.yb)
    assert new._handle().env is not old._h.env  # type: ignore[union-attr]
    with pytest.raises(StoreReplacedError, match=r"replaced.*another"):
        old.read_batch([0])
    old.refresh()
    np.testing.assert_array_equal(old.labels(), orig.yb)
    old.close()
    new.close()


@pytest.mark.parametrize("lock", [False, True])
def test_in_place_copy_of_a_store_written_the_same_way_is_refused(orig: Originals, tmp_path: Path, lock: bool) -> None:
    """Issue 25 #1: byte-identical meta pages; the record fingerprint tells the stores apart, also under a live
    registered transaction, which never looked at the file before."""
    a = tmp_path / "a"
    shutil.copytree(orig.a, a)
    r = StoreReader(a, lock=lock)
    labels = r.labels()
    np.testing.assert_array_equal(r.read_batch([5, 6]), orig.xa[[5, 6]])
    shutil.copyfile(orig.b / "data.mdb", a / "data.mdb")
    with pytest.raises(StoreReplacedError) as exc:
        r.read_batch([5, 6])
    assert "\n" not in str(exc.value)
    np.testing.assert_array_equal(labels, orig.ya)
    r.close()


def test_a_set_keeps_the_labels_of_its_layout_when_a_store_grows(orig: Originals, tmp_path: Path) -> None:
    """Issue 25 #3: after 300 appends to the first store, the second store's labels do not shift."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(orig.a, a)
    copy_store(orig.b, b)  # an id of its own
    s = StoreSet([a, b]).open()
    x, y = make_data(300, seed=14)
    with open_writer(a) as w:
        w.append(x, y)
    s.close()  # re-opened on the next read: the stores' newest snapshots
    assert len(s) == 2 * N and s.counts == [N, N]
    np.testing.assert_array_equal(s.labels(), np.concatenate([orig.ya, orig.yb]))
    np.testing.assert_array_equal(s.read_batch(np.arange(N, 2 * N)), orig.xb)
    for c in range(5):
        want = np.flatnonzero(np.concatenate([orig.ya, orig.yb]) == c)
        np.testing.assert_array_equal(s.class_indices(c), want)
    assert sum(s.meta.class_counts) == 2 * N
    s.refresh()  # laid out anew: now with the appended samples
    assert s.counts == [N + 300, N]
    np.testing.assert_array_equal(s.labels()[N : N + 300], y)
    s.close()


def test_a_set_refuses_one_store_twice_and_bad_class_names(orig: Originals, tmp_path: Path) -> None:
    shutil.copytree(orig.a, tmp_path / "copy")  # cp -r: the same store id
    s = StoreSet([orig.a, tmp_path / "copy"])
    with pytest.raises(LmdbStoreError, match="same store id") as exc:
        s.open()
    assert "\n" not in str(exc.value)
    (tmp_path / "link").symlink_to(orig.a)
    with pytest.raises(ValueError, match="given twice"):
        StoreSet([orig.a, tmp_path / "link"])
    for classes in (["a", "b", "a"], ["a", "b\0"], ["a", ""], ["a", 1]):
        with pytest.raises(ValueError, match="classes"):
            StoreSet([orig.a, orig.b], classes=classes)  # type: ignore[list-item]


@pytest.mark.parametrize("kind", ["reader", "set"])
def test_read_batch_refuses_float_indices_and_masks(orig: Originals, kind: str) -> None:
    r: Any = StoreReader(orig.a) if kind == "reader" else StoreSet([orig.a, orig.b])
    for bad in ([1.7], np.array([0.0, 2.0]), np.ones(N, bool), [True, False]):
        with pytest.raises(ValueError, match="indices"):
            r.read_batch(bad)
        with pytest.raises(ValueError, match="indices"):
            r.labels_of(bad)
    np.testing.assert_array_equal(r.read_batch(np.array([3], np.uint32)), orig.xa[[3]])
    assert r.read_batch([]).shape == (0, 25, 25)
    r.close()


def test_registry_entries_follow_the_data_file(orig: Originals, tmp_path: Path) -> None:
    a = tmp_path / "a"
    shutil.copytree(orig.a, a)
    r = StoreReader(a).open()
    first = r._handle().lease.entry
    assert first.data_file == (os.stat(a / "data.mdb").st_dev, os.stat(a / "data.mdb").st_ino)
    _rename(a, orig, tmp_path)
    r2 = StoreReader(a).open()
    assert r2._handle().lease.entry is not first and ENVS.current(os.path.realpath(a)) is r2._handle().lease.entry
    with pytest.raises(StoreReplacedError):
        r.read_batch([0])
    r.close()
    r2.close()
