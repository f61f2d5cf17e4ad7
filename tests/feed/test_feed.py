"""The torch-free feed under every adapter (lmdbstore.feed: feed, readers, slots, idle, opening): real reader
processes over real stores.  Every pass reads every sample of its split once, in the sampler's
next order; batches are channels-last; a consumer keeping batches never sees them overwritten; a transform
runs in the readers; errors of the store, of a transform or of a dead reader are one line; closing stops
the readers and frees the shared memory; the readers stay between passes and stop when none comes."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import SET_CLASSES, StoreInfo, build_set, damage_store

from lmdbstore.config import FeedConfig
from lmdbstore.errors import CorruptStoreError, LmdbStoreError
from lmdbstore.feed import idle
from lmdbstore.feed.feed import BatchFeed
from lmdbstore.feed.opening import loader_config, open_feed
from lmdbstore.feed.slots import SHM_DIR, SharedSlots
from lmdbstore.loader.choose import split_indices
from lmdbstore.util.lifeline import process_start_time
from lmdbstore.util.workers import PassedFd

BATCH = 64


def _feed(info: StoreInfo, **options: object) -> BatchFeed:
    options.setdefault("batch_size", BATCH)
    options.setdefault("multiprocessing_context", "fork")
    return open_feed(info.path, loader_config(None, options), channels="last")


def _pass(feed: BatchFeed, keep: bool = False) -> list[np.ndarray]:
    """One pass; the sample numbers of each batch (the first value of a test sample encodes it), or with
    ``keep`` the batches' arrays themselves, held until the end."""
    feed.begin()
    out = []
    while True:
        try:
            x, y = feed.next()
        except StopIteration:
            return out
        out.append((x, y) if keep else np.rint(x.reshape(len(x), -1)[:, 0]).astype(np.int64))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_pass_reads_the_split_once_in_the_next_order(small_store: StoreInfo, workers: int) -> None:
    feed = _feed(small_store, split="train", workers=workers)
    train = split_indices(small_store.y, "train", 0.1, 0)
    passes = [_pass(feed) for _ in range(3)]
    for epoch, batches in enumerate(passes):
        assert len(batches) == len(feed) == -(-len(train) // BATCH)
        assert [b.tolist() for b in batches] == [b.tolist() for b in feed.sampler.batches_from(epoch, 0)]
        np.testing.assert_array_equal(np.sort(np.concatenate(batches)), train)
    assert passes[0][0].tolist() != passes[1][0].tolist()
    feed.close()


def test_batches_are_channels_last_with_their_labels(store_factory: Callable[..., StoreInfo]) -> None:
    info = store_factory(300, shape=(3, 8, 6), dtype=np.uint16)  # (C, H, W) samples
    feed = _feed(info, workers=2, shuffle="none")
    feed.begin()
    x, y = feed.next()
    assert x.shape == (BATCH, 8, 6, 3) and x.dtype == np.uint16 and y.dtype == np.int64
    np.testing.assert_array_equal(x, info.x[:BATCH].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(y, info.y[:BATCH])
    flat = _feed(info, workers=0, shuffle="none", channels="stored")
    flat.begin()
    np.testing.assert_array_equal(flat.next()[0], info.x[:BATCH])


@pytest.mark.parametrize("workers", [0, 2])
def test_kept_batches_are_never_overwritten(small_store: StoreInfo, workers: int) -> None:
    feed = _feed(small_store, workers=workers)
    for _ in range(2):
        kept = _pass(feed, keep=True)  # more batches than slots: the rest are read into fresh memory
        order = feed.plan
        assert len(kept) == len(order) > feed.slots.n
        for (x, y), idx in zip(kept, order, strict=True):
            np.testing.assert_array_equal(x[..., 0], small_store.x[idx])
            np.testing.assert_array_equal(y, small_store.y[idx])
        del kept
    # once nothing is kept, every slot comes back
    _pass(feed)
    assert feed.state.count(0) >= feed.slots.n - 1


def _flatten(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x.reshape(len(x), -1), y  # another shape, still a view of the slot


@pytest.mark.parametrize("workers", [0, 2])
def test_kept_batches_a_transform_returned_as_views_of_their_slots_are_never_overwritten(
    small_store: StoreInfo, workers: int
) -> None:
    """Issue 39: read in the consumer's thread, such a batch's slot was free at once and the next batch
    overwrote it."""
    cfg = loader_config(None, {"batch_size": BATCH, "workers": workers, "multiprocessing_context": "fork"})
    feed = open_feed(small_store.path, cfg, transform=_flatten)
    kept = _pass(feed, keep=True)
    for (x, y), idx in zip(kept, feed.plan, strict=True):
        np.testing.assert_array_equal(x, small_store.x[idx].reshape(len(idx), -1))
        np.testing.assert_array_equal(y, small_store.y[idx])


def test_an_abandoned_pass_gives_way_to_a_whole_new_one(small_store: StoreInfo) -> None:
    feed = _feed(small_store, workers=2)
    feed.begin()
    feed.next()
    feed.next()  # readers are working ahead
    batches = _pass(feed)
    assert [b.tolist() for b in batches] == [b.tolist() for b in feed.sampler.batches_from(1, 0)]


def _ids(x: np.ndarray) -> list[int]:
    return np.rint(x.reshape(len(x), -1)[:, 0]).astype(np.int64).tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_the_state_counts_batches_handed_out_and_resumes_after_them(small_store: StoreInfo, workers: int) -> None:
    """Issue 25 #6 for the feeds: after k batches the state says k (the sampler's own counts those read
    ahead), and a new feed resumed from it yields exactly the rest of that epoch's samples, then whole epochs."""
    train = split_indices(small_store.y, "train", 0.1, 0)
    feed = _feed(small_store, split="train", workers=workers)
    _pass(feed)  # epoch 0, whole
    feed.begin()  # epoch 1
    assert feed.state_dict()["epoch"] == 1 and feed.state_dict()["position"] == 0
    k = 3
    taken = [_ids(feed.next()[0]) for _ in range(k)]
    state = feed.state_dict()
    assert (state["epoch"], state["position"]) == (1, k)
    if workers:
        assert feed.sampler.state_dict()["position"] > k  # the readers read ahead: the sampler drew more
    assert feed.state_dict(taken=1)["position"] == 1  # a consumer holding batches says what it used
    for bad in (-1, k + 1, 1.0, True):
        with pytest.raises(ValueError, match="taken"):
            feed.state_dict(taken=bad)  # type: ignore[arg-type]
    feed.close()  # mid-pass: what was read ahead is dropped, the state stays at k
    assert feed.state_dict() == state

    resumed = _feed(small_store, split="train", workers=workers)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # pinned, nothing handed out yet
    rest = _pass(resumed)
    assert len(rest) == len(feed) - k
    assert [b.tolist() for b in rest] == [b.tolist() for b in resumed.sampler.batches_from(1, k)]
    together = sorted(i for b in [*taken, *(r.tolist() for r in rest)] for i in b)
    assert together == train.tolist()  # every sample of the epoch once: none lost, none twice
    end = resumed.state_dict()
    assert (end["epoch"], end["position"]) == (1, len(feed))
    after = _pass(resumed)  # then the whole next epoch
    assert [b.tolist() for b in after] == [b.tolist() for b in resumed.sampler.batches_from(2, 0)]
    with pytest.raises(ValueError, match="batch_size"):
        _feed(small_store, split="train", workers=0, batch_size=32).load_state_dict(state)
    resumed.close()


def test_peek_and_read_do_not_move_the_pass(small_store: StoreInfo) -> None:
    feed = _feed(small_store, workers=2)
    x0, _ = feed.peek(3)  # batch 3 of the next pass, before it begins
    first = _pass(feed)
    np.testing.assert_array_equal(np.rint(x0[:, 0, 0, 0]), first[3])
    x, _ = feed.read(5)  # batch 5 of this pass, again
    np.testing.assert_array_equal(np.rint(x[:, 0, 0, 0]), first[5])
    with pytest.raises(IndexError):
        feed.peek(len(feed))


def add_one(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x += 1
    return x, y


def crop(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x[:, 5:10, 5:10].copy(), y


def broken(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    raise ValueError("augmentation failed\nwith a second line")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_transform_runs_in_the_readers(small_store: StoreInfo, context: str) -> None:
    feed = open_feed(
        small_store.path,
        FeedConfig(batch_size=BATCH, workers=2, multiprocessing_context=context),
        channels="last",
        transform=add_one,
    )
    feed.begin()
    x, _ = feed.next()
    np.testing.assert_allclose(x[..., 0], small_store.x[feed.plan[0]] + 1, rtol=1e-6)
    cropped = open_feed(small_store.path, FeedConfig(batch_size=BATCH, workers=2), channels="last", transform=crop)
    cropped.begin()
    assert cropped.next()[0].shape == (BATCH, 5, 5, 1)


def test_errors_are_one_line(small_store: StoreInfo, tmp_path: Path) -> None:
    feed = open_feed(small_store.path, FeedConfig(batch_size=BATCH, workers=2), channels="last", transform=broken)
    feed.begin()
    with pytest.raises(ValueError, match=r"^augmentation failed") as err:  # the transform's own exception
        feed.next()
    cause = str(err.value.__cause__)  # with the reader's traceback
    assert "Traceback" in cause and "in broken" in cause and 'raise ValueError("augmentation failed' in cause
    with pytest.raises(ValueError, match="unknown option 'batch'"):
        loader_config(None, {"batch": 3})
    with pytest.raises(ValueError, match="split"):
        loader_config(None, {"split": "test"})
    with pytest.raises(ValueError, match="indices or a split"):
        open_feed(small_store.path, FeedConfig(split="val"), channels="last", indices=[1, 2])
    with pytest.raises(IndexError, match="sample index 2000 out of range"):  # the reader's rule
        open_feed(small_store.path, FeedConfig(), channels="last", indices=[2000])


def test_a_damaged_store_is_a_corrupt_store_error_from_the_readers(store_factory: Callable[..., StoreInfo]) -> None:
    info = store_factory(3000)
    feed = _feed(info, workers=2, shuffle="none")
    damage_store(info.path, "garble_leaf")
    with pytest.raises(CorruptStoreError) as err:
        _pass(feed)
    assert "\n" not in str(err.value)


def test_a_dead_reader_is_one_line_and_nothing_is_left_behind(small_store: StoreInfo) -> None:
    feed = _feed(small_store, workers=2)
    feed.begin()
    feed.next()
    pool = feed.pool
    assert feed.slots.fd is not None and not _named_segments()  # an anonymous segment: nothing in /dev/shm
    for p in pool.procs:  # type: ignore[union-attr]
        p.kill()
        p.join()
    with pytest.raises(LmdbStoreError, match=r"reader process \d died"):
        for _ in range(len(feed)):
            feed.next()
    feed.close()
    healthy = _feed(small_store, workers=2)
    _pass(healthy)
    procs = list(healthy.pool.procs)  # type: ignore[union-attr]
    healthy.close()
    assert not any(p.is_alive() for p in procs)
    assert healthy.slots.fd is None and not _named_segments()


def _named_segments() -> list[str]:
    """Slot segments with a name in /dev/shm (there should never be any)."""
    return [n for n in os.listdir(SHM_DIR) if n.startswith("lmdbstore-slots-")]


def test_without_memfd_the_segment_is_a_file_removed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no memfd exists (not Linux) the segment is a file in /dev/shm removed as soon as it is open:
    nothing to leave behind, whatever kills the processes; a reader maps it by its descriptor."""
    monkeypatch.delattr(os, "memfd_create")
    slots = SharedSlots(2, 10, 100)
    assert slots.fd is not None and not _named_segments()
    assert os.fstat(slots.fd).st_nlink == 0  # no name anywhere
    reader_side = SharedSlots(2, 10, 100, segment=PassedFd(os.dup(slots.fd)))
    slots.y(1, 10)[:] = np.arange(10)
    np.testing.assert_array_equal(reader_side.y(1, 10), np.arange(10))  # the same memory
    reader_side.close()
    slots.close()


@pytest.mark.parametrize("shuffle", ["random", "block", "window", "none", "balanced"])
def test_a_feed_reads_a_set_of_stores_in_every_order(tmp_path: Path, shuffle: str) -> None:
    """keras_dataset([a, b, c]) / tf_dataset([a, b, c]) are feeds over the set: one index space, classes by name."""
    info = build_set(tmp_path)
    opts: dict[str, object] = {"balanced": True} if shuffle == "balanced" else {"shuffle": shuffle}
    if shuffle == "window":
        opts["window_mb"] = 1
    feed = open_feed(info.paths, loader_config(None, {"batch_size": BATCH, "workers": 2, "split": "train",
                                                    "multiprocessing_context": "fork", **opts}), channels="last")  # fmt: skip
    labels = np.array([SET_CLASSES.index(n) for n in info.names])
    train = split_indices(labels, "train", 0.1, 0)
    for _epoch in range(2):
        peeked = feed.peek(0)[0].copy()  # the next pass's first batch, read here without starting it
        feed.begin()
        seen = []
        for k in range(len(feed)):
            x, y = feed.next()
            idx = np.rint(x[:, 0, 0, 0]).astype(np.int64)
            np.testing.assert_array_equal(x[..., 0], info.x[idx])
            np.testing.assert_array_equal(y, labels[idx])
            if k == 0:
                np.testing.assert_array_equal(x, peeked)
                np.testing.assert_array_equal(feed.read(0)[0], x)  # read again: the same batch
            seen.append(idx)
        if shuffle != "balanced":  # balanced draws with replacement
            np.testing.assert_array_equal(np.sort(np.concatenate(seen)), train)
    feed.close()


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if process_start_time(p) is not None]


def test_readers_stay_between_passes_and_stop_when_none_comes(
    small_store: StoreInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reader start per epoch: the same processes serve pass after pass; once no pass began for the idle
    time after one ended they stop (a framework may keep the dataset for good), and the next pass starts
    new ones, in the same order of epochs as ever."""
    monkeypatch.setattr(idle, "IDLE_MIN_SECONDS", 1.0)
    feed = _feed(small_store, split="train", workers=2)
    first = _pass(feed)
    pids = [p.pid for p in feed.pool.procs]  # type: ignore[union-attr]
    second = _pass(feed)  # begun within the idle time: the same readers
    assert [p.pid for p in feed.pool.procs] == pids and len(_alive(pids)) == 2  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while feed.pool is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert feed.pool is None and feed.slots.closed  # stopped by the idle thread, memory freed
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids)
    third = _pass(feed)  # new readers, the next epoch's order
    assert set(p.pid for p in feed.pool.procs).isdisjoint(pids)  # type: ignore[union-attr]
    for epoch, batches in enumerate([first, second, third]):
        assert [b.tolist() for b in batches] == [b.tolist() for b in feed.sampler.batches_from(epoch, 0)]
    feed.close()


def test_a_pass_begun_in_time_keeps_the_readers_and_a_collected_feed_leaves_nothing(
    small_store: StoreInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idle, "IDLE_MIN_SECONDS", 0.5)
    feed = _feed(small_store, workers=2)
    _pass(feed)
    pids = [p.pid for p in feed.pool.procs]  # type: ignore[union-attr]
    for _ in range(4):  # each pass begins before the idle time is up: never stopped
        time.sleep(0.3)
        feed.begin()
        feed.next()
        feed.rest()  # abandoned after a batch: resting too
    assert [p.pid for p in feed.pool.procs] == pids  # type: ignore[union-attr]
    thread = feed.idle._thread
    assert thread is not None and thread.is_alive()
    del feed
    gc.collect()
    deadline = time.monotonic() + 10
    while (_alive(pids) or thread.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids) and not thread.is_alive()  # collected: readers and the idle thread gone at once


def test_readers_of_a_pass_left_midway_stop_and_the_pass_goes_on_where_it_was(
    small_store: StoreInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35 #11: a loop that breaks out after 3 batches and keeps the dataset (tf_dataset, a Keras dataset, a
    loader) held its readers for good.  Now they stop once no batch was asked for in the idle time, also inside a
    pass; the pass stays where it was, and its next batch starts new readers: the rest of the epoch, in order,
    every sample once (the batches read ahead are read again, not lost)."""
    monkeypatch.setattr(idle, "IDLE_MIN_SECONDS", 0.5)
    feed = _feed(small_store, workers=2)
    feed.begin()
    head = [_ids(feed.next()[0]) for _ in range(3)]  # then the loop breaks out, keeping the feed
    pids = [p.pid for p in feed.pool.procs]  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while (feed.pool is not None or _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert feed.pool is None and not _alive(pids)  # stopped mid-pass, nothing left running
    rest = []
    while True:
        try:
            rest.append(_ids(feed.next()[0]))
        except StopIteration:
            break
    assert head + rest == [b.tolist() for b in feed.sampler.batches_from(0, 0)]
    assert feed.state_dict()["position"] == len(feed)
    feed.close()
