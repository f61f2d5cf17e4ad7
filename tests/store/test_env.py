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
