"""One shared environment per path and process (lmdbstore.store.registry.EnvRegistry)."""

from __future__ import annotations

import gc
import multiprocessing as mp
from typing import Any

import numpy as np
from conftest import StoreInfo, make_data

from lmdbstore import WriterConfig, open_writer
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.registry import ENVS
from lmdbstore.tools.stats import store_stats
from lmdbstore.tools.verify import verify_store


def test_many_readers_of_one_store_in_one_process(small_store: StoreInfo) -> None:
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset

    x = small_store.x
    a = StoreReader(small_store.path).open()
    b = StoreReader(small_store.path, lock=True).open()  # needs a reader table: the environment is re-opened
    c = StoreReader(small_store.path, positions=False).open()
    ds = LmdbBatchDataset(small_store.path)  # used to fail with "already open in this process"
    idx = np.array([5, 1999, 0])
    for r in (a, b, c):
        np.testing.assert_array_equal(r.read_batch(idx), x[idx])
    np.testing.assert_array_equal(ds[idx][0][:, 0].numpy(), x[idx])
    assert store_stats(small_store.path)["samples"] == 2000  # stats beside open readers
    assert verify_store(small_store.path).ok
    assert a._handle().env is b._handle().env is c._handle().env  # one environment, shared
    for r in (a, b, c):
        r.close()
    ds.reader.close()
    assert ENVS.current(str(small_store.path.resolve())) is None  # the last user closed it


def test_dropped_reader_gives_its_share_back(small_store: StoreInfo) -> None:
    r = StoreReader(small_store.path).open()
    key = str(small_store.path.resolve())
    assert ENVS.current(key) is not None
    del r
    gc.collect()
    assert ENVS.current(key) is None


def test_writer_beside_readers(small_store: StoreInfo) -> None:
    path, x = small_store.path, small_store.x
    r = StoreReader(path).open()
    np.testing.assert_array_equal(r.read_batch([0, 1999]), x[[0, 1999]])
    more, _ = make_data(100, seed=77)
    with open_writer(path, config=WriterConfig(sync=False)) as w:  # shares (re-opens) the environment
        w.append(more, 1)
        w.commit()
        r2 = StoreReader(path).open()  # a reader opened beside the writer sees the commit
        assert len(r2) == 2100
        np.testing.assert_array_equal(r2.read_batch([2099, 0]), np.stack([more[99], x[0]]))
        # the first reader's environment was re-opened for the writer: it continues on a fresh snapshot
        np.testing.assert_array_equal(r.read_batch([1999, 2000]), np.stack([x[1999], more[0]]))
        w.append(more[:10], 2)
    assert len(r2) == 2100  # its snapshot stays until refresh()
    r2.refresh()
    assert len(r2) == 2110
    r.close()
    r2.close()
    assert ENVS.current(str(path.resolve())) is None


def _child(path: Any, conn: Any) -> None:
    try:
        a, b = StoreReader(path), StoreReader(path, lock=True)
        conn.send(("ok", a.read_batch([3, 4]), b.read_batch([5])))
    except BaseException as exc:
        conn.send(("error", repr(exc), None))
    finally:
        conn.close()


def test_registry_is_fork_aware(small_store: StoreInfo) -> None:
    """Lock-free readers open in the parent do not stop a forked child from opening its own readers
    (a parent's ``lock=True`` environment cannot be closed in the child without freeing the parent's
    reader slot, so one of those must be closed before forking, as before)."""
    parent = [StoreReader(small_store.path).open(), StoreReader(small_store.path, positions=False).open()]
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_child, args=(small_store.path, there))
    p.start()
    status, ab, b = here.recv()
    p.join(60)
    assert status == "ok", ab
    np.testing.assert_array_equal(ab, small_store.x[[3, 4]])
    np.testing.assert_array_equal(b, small_store.x[[5]])
    for r in parent:  # the parent's environment and reader slot are untouched
        np.testing.assert_array_equal(r.read_batch([7]), small_store.x[[7]])
        r.close()


def test_writers_and_readers_in_any_order_beside_a_reader_reading_throughout(tmp_path: Any) -> None:
    """One process: a reader reads on its thread the whole time while a writer per chunk is opened and closed,
    readers of every mode come and go, and a reader outlives each writer (issue 34 #8: the second
    ``open_writer`` failed "already open in this process", the reader holding the first writer's environment,
    or was refused as another writer while the reader probed the lock).  Every batch is its own samples; every
    writer opens; the last user closes the environment."""
    import threading

    path = tmp_path / "s"
    x, y = make_data(3000, seed=8)
    cfg = WriterConfig(sync=False)
    with open_writer(path, shape=(25, 25), dtype="float32", classes=list("abcde"), config=cfg) as w:
        w.append(x[:300], y[:300])
    reader = StoreReader(path)
    stop, errors, batches = threading.Event(), [], [0]

    def read() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            try:
                b = rng.integers(0, 300, 64)
                assert reader.read_batch(b).tobytes() == x[b].tobytes()
                batches[0] += 1
            except BaseException as exc:  # reported below
                errors.append(repr(exc))
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        rng = np.random.default_rng(2)
        others: list[StoreReader] = []
        for i, lo in enumerate(range(300, 3000, 300)):
            kind = int(rng.integers(0, 3))
            if kind == 1:  # a reader of another mode opened before the writer, kept across it
                others.append(StoreReader(path, lock=bool(i % 2), positions=i % 3 != 0).open())
            with open_writer(path, config=cfg) as w:
                w.append(x[lo : lo + 300], y[lo : lo + 300])
                if kind == 2:  # a reader opened beside the writer, kept after it
                    others.append(StoreReader(path).open())
            for r in others:
                n = len(r)
                assert r.read_batch([n - 1, 0]).tobytes() == x[[n - 1, 0]].tobytes()
            if len(others) > 2:
                others.pop(0).close()
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert batches[0] > 0
    for r in others:
        r.close()
    reader.refresh()
    assert len(reader) == 3000 and reader.read_batch([2999]).tobytes() == x[[2999]].tobytes()
    reader.close()
    assert ENVS.current(str(path.resolve())) is None
