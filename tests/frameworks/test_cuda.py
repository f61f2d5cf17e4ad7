"""The GPU path's logic on the CPU (lmdbstore.frameworks.cuda and the feed's fences): a slot -- or a page-locked
buffer of the copy thread -- is written again only after the copy that read it has finished, told by an event
recorded when the batch was let go.  Stand-in events play CUDA's (``query()`` false until the test says the copy
is done); the real registration and staging run in `python -m scripts.bench gpu` on a GPU."""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import StoreInfo

from lmdbstore import EpochBatchSampler
from lmdbstore.config import LoaderConfig
from lmdbstore.feed.feed import FENCED, FREE
from lmdbstore.feed.opening import open_feed
from lmdbstore.frameworks.cuda import PinnedCopies

BATCH = 100


class Copy:
    """A stand-in CUDA event: recorded when a batch is let go, done when the test says the copy finished."""

    made: ClassVar[list[Copy]] = []

    def __init__(self) -> None:
        self.done = False
        Copy.made.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _ids(x: np.ndarray) -> list[int]:
    return np.rint(x.reshape(len(x), -1)[:, 0]).astype(np.int64).tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_slot_is_reused_only_after_its_copy_finished(small_store: StoreInfo, workers: int) -> None:
    Copy.made = []
    sampler = EpochBatchSampler(np.arange(2000), BATCH, shuffle="none")
    feed = open_feed(small_store.path, LoaderConfig(batch_size=BATCH, workers=workers, prefetch=1), channels="first",
                     sampler=sampler, fence=Copy)  # fmt: skip
    feed.begin()
    x, y = feed.next()
    first = int(np.flatnonzero(np.array(feed.state) == 2)[0])  # HELD
    del x, y  # let go: "copied" asynchronously, not yet done
    seen = [_ids(feed.next()[0])]
    assert feed.state[first] == FENCED and len(Copy.made) == 1
    for _ in range(6):  # the other slots turn over (their copies done at once); this one waits for its copy
        assert feed.state[first] == FENCED
        for c in Copy.made[1:]:
            c.done = True
        seen.append(_ids(feed.next()[0]))
    Copy.made[0].done = True
    feed.next()
    assert feed.state[first] != FENCED  # copy done: the slot is free and used again
    assert all(c.done or c is not Copy.made[0] for c in Copy.made)
    for k, ids in enumerate(seen, start=1):
        assert ids == list(range(k * BATCH, (k + 1) * BATCH))  # every batch right, in order
    feed.close()  # waits for every copy still running (synchronize) before unmapping
    assert all(c.done for c in Copy.made)


def test_when_every_slot_waits_for_a_copy_the_feed_waits_for_the_copies(small_store: StoreInfo) -> None:
    Copy.made = []
    feed = open_feed(small_store.path, LoaderConfig(batch_size=BATCH, workers=0, shuffle="none"), fence=Copy)
    feed.begin()
    for _ in range(len(feed)):
        batch = feed.next()  # each let go at the next call: fenced, never done by itself
    del batch
    assert feed.came["here"] == 0  # no batch fell back to a read into fresh memory
    assert all(c.done for c in Copy.made[:-2])
    assert FREE in feed.state


def test_a_pinned_buffer_is_reused_only_when_released_and_copied() -> None:
    Copy.made = []
    copies = PinnedCopies(BATCH, (1, 25, 25), torch.float32, Copy, pinned=False)
    stop = threading.Event()
    taken, handed = [], []
    for _ in range(4):  # as the copy thread does: a buffer taken is handed out before the next is taken
        taken.append(copies._take(stop))
        handed.append(torch.from_numpy(copies.bases[taken[-1]][:64]))  # type: ignore[index]  # the loop holds it
    assert sorted(taken) == [0, 1, 2, 3]  # type: ignore[type-var]
    assert copies._take(stop) is None and not Copy.made  # held, not let go: the next batch gets fresh memory
    del handed[2]  # let go, but its device copy is still running
    timer = threading.Timer(0.02, lambda: setattr(Copy.made[0], "done", True))
    timer.start()
    assert copies._take(stop) == taken[2] and len(Copy.made) == 1  # waited for the copy, then reused
    timer.join()
    del handed[0]
    assert copies._take(stop) == taken[0] and Copy.made[1].done  # never done by itself: waited for (synchronize)
    stop.set()
    assert copies._take(stop) is None


def test_the_copy_thread_delivers_every_batch_right_kept_or_not(small_store: StoreInfo) -> None:
    sampler = EpochBatchSampler(np.arange(2000), BATCH, shuffle="none")
    feed = open_feed(small_store.path, LoaderConfig(batch_size=BATCH, workers=2), channels="first", sampler=sampler)

    def batches():  # type: ignore[no-untyped-def]
        feed.begin()
        while True:
            try:
                x, y = feed.next()
            except StopIteration:
                return
            yield torch.from_numpy(x), torch.from_numpy(y)

    for keep in (True, False):
        Copy.made = []
        seen, kept = [], []
        for x, y in PinnedCopies(BATCH, (1, 25, 25), torch.float32, Copy, pinned=False)(batches()):
            seen.append(_ids(x.numpy()))
            np.testing.assert_array_equal(y.numpy(), small_store.y[seen[-1]])
            for c in Copy.made:
                c.done = True
            if keep:
                kept.append((x, y))
        assert seen == [list(range(k * BATCH, (k + 1) * BATCH)) for k in range(20)]
        for k, (x, _) in enumerate(kept):  # kept batches never overwritten
            assert _ids(x.numpy()) == list(range(k * BATCH, (k + 1) * BATCH))
    feed.close()


def test_the_copy_thread_raises_a_readers_error_and_stops_when_abandoned(small_store: StoreInfo) -> None:
    def failing():  # type: ignore[no-untyped-def]
        yield torch.zeros(BATCH, 1, 25, 25), torch.zeros(BATCH, dtype=torch.int64)
        raise ValueError("a reader failed")

    copies = PinnedCopies(BATCH, (1, 25, 25), torch.float32, None, pinned=False)
    out = copies(failing())
    next(out)
    with pytest.raises(ValueError, match="a reader failed"):
        next(out)
    endless = copies(iter(lambda: (torch.zeros(BATCH, 1, 25, 25), torch.zeros(BATCH, dtype=torch.int64)), None))
    next(endless)
    before = threading.active_count()
    endless.close()  # abandoned: its thread ends
    assert threading.active_count() <= before - 1 or not any(t.name == "lmdbstore-pin" for t in threading.enumerate())
