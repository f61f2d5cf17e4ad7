"""How many slots a feed makes and how large (lmdbstore.feed.slots, feed, opening): bounded by the data and the
machine, never by an argument alone.  Issue 34 #6: 2 workers at batch 1,000,000 asked 23.3 GiB for a
3,000-sample store, and ``eval --workers 100000`` was OOM-killed."""

from __future__ import annotations

import resource
import warnings
from collections.abc import Callable

import numpy as np
import pytest
from conftest import StoreInfo

from lmdbstore import BalancedBatchSampler, EpochBatchSampler, LmdbBatchDataset, make_loader
from lmdbstore.config import LoaderConfig
from lmdbstore.feed import slots as slots_module
from lmdbstore.feed.feed import largest_batch
from lmdbstore.feed.opening import loader_config, open_feed
from lmdbstore.util import memory
from lmdbstore.util.procs import WORKERS_PER_CORE

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def test_a_slot_never_holds_more_rows_than_the_store(store_factory: Callable[..., StoreInfo]) -> None:
    info = store_factory(300, seed=2)
    big = EpochBatchSampler(np.arange(300), 1_000_000)
    assert largest_batch(big, 300) == 300
    assert largest_batch(BalancedBatchSampler([np.arange(5)], 700, num_batches=2), 300) == 700  # with replacement
    assert largest_batch([np.arange(3), np.arange(9)], 300) == 9
    assert largest_batch(iter(()), 300) == 300  # says nothing: at most the store
    loader = make_loader(info.path, batch_size=1_000_000, workers=2)
    assert loader.feed.rows == 300 and loader.feed.slots.nbytes < 300 * 2500 * 16
    ((x, y),) = list(loader)  # one batch of every sample
    assert len(x) == len(y) == 300


def test_absurd_workers_and_batch_on_a_tiny_store_stay_bounded(store_factory: Callable[..., StoreInfo]) -> None:
    info = store_factory(300, seed=3)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.warns(UserWarning, match=r"workers: 100,000 worker processes on \d+ cores would only contend"):
        loader = make_loader(info.path, batch_size=10**6, workers=100_000, prefetch=10**4)
    assert loader.feed.workers == 1 and loader.num_workers == 1  # one batch a pass: one reader
    assert loader.feed.slots.nbytes < 64 * 2**20  # slots: bounded by the data
    xs = [x for x, _ in loader]
    assert sum(len(x) for x in xs) == 300
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: no giant allocation
    loader.close()
    with pytest.warns(UserWarning, match="cores"):
        many = make_loader(info.path, batch_size=1, workers=10**5)
    assert many.feed.workers == WORKERS_PER_CORE * (__import__("os").cpu_count() or 1)
    many.close()


def test_slots_that_do_not_fit_in_memory_are_fewer_or_refused(
    small_store: StoreInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = loader_config(None, {"batch_size": 200, "workers": 2, "prefetch": 8})
    stride = slots_module.slot_bytes(200, 2500)[1]
    monkeypatch.setattr(memory, "available_memory", lambda: 12 * stride)  # room for 6 slots (half of it)
    with pytest.warns(memory.MemoryBoundWarning) as said:
        feed = open_feed(small_store.path, cfg)
    lines = [str(w.message) for w in said]
    assert lines[0].startswith("workers: 2 worker processes of 256.0 MiB") and lines[0].endswith("using 1")
    assert lines[1].startswith("prefetch: 11 batch slots of") and lines[1].endswith("using 6")  # 1 x 8 + 3
    assert feed.slots.n == 6 and feed.depth == 5 and feed.workers == 1
    feed.begin()
    assert sum(len(feed.next()[1]) for _ in range(len(feed))) == 2000
    feed.close()
    monkeypatch.setattr(memory, "available_memory", lambda: 3 * stride)  # room for 1.5: not even 2
    with pytest.raises(ValueError, match=r"^batch_size: 2 batch slots .* would take .* lower batch_size$"):
        open_feed(small_store.path, cfg)  # not even one for the one reader and one for the consumer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(memory, "available_memory", lambda: 2**40)  # plenty: as asked
        assert open_feed(small_store.path, cfg).slots.n == 10 + 3  # a pass of 10 batches read ahead at most


def test_an_argument_that_is_no_integer_is_refused_naming_it() -> None:
    for field, bad in [("batch_size", 0), ("batch_size", 2.5), ("workers", -1), ("prefetch", 0), ("seed", "1"),
                       ("workers", True), ("window_mb", 0), ("block_buffer", 1.0)]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            LoaderConfig(**{field: bad})


def test_kept_samples_alone_keep_their_slot(small_store: StoreInfo) -> None:
    """A consumer keeping only ``x`` of each batch (the labels dropped) still holds the slot: a slot is free
    when nothing references any of its memory (the reference counts were off by one, so a batch held by one
    reference was taken for free and overwritten)."""
    loader = make_loader(LmdbBatchDataset(small_store.path), EpochBatchSampler(np.arange(2000), 100, shuffle="none"),
                         LoaderConfig(workers=1))  # fmt: skip
    kept = [x for x, _ in loader]
    assert len(kept) == 20 > loader.feed.slots.n
    for k, x in enumerate(kept):
        np.testing.assert_array_equal(x[:, 0].numpy(), small_store.x[k * 100 : (k + 1) * 100])
