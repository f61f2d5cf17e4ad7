"""The batch dataset and real DataLoader workers: every sample exactly once, in every worker setup.

The first pixel of every sample written by ``make_data`` is its index, so each test knows exactly which
samples a loader delivered, and checks that samples, labels and indices belong together.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
from conftest import StoreInfo

from lmdbstore import LoaderConfig, StoreReader, open_reader
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler


def epoch_sampler(ds: LmdbBatchDataset, cfg: LoaderConfig, indices: np.ndarray | None = None) -> EpochBatchSampler:
    idx = np.arange(len(ds)) if indices is None else indices
    spv = ds.reader.meta.samples_per_value
    ds.reader.close()
    return EpochBatchSampler(
        idx,
        cfg.batch_size,
        shuffle="random" if cfg.order == "auto" else cfg.order,  # type: ignore[arg-type]  # no window here
        samples_per_value=spv,
        block_buffer=cfg.block_buffer,
        seed=cfg.seed,
    )


def collect(loader: torch.utils.data.DataLoader, info: StoreInfo) -> np.ndarray:
    """Run one epoch; check every batch against the store's data and return the indices delivered."""
    seen = []
    for x, y in loader:
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.ndim == 4 and x.shape[1:] == (1, 25, 25) and len(y) == len(x)
        idx = x[:, 0, 0, 0].numpy().astype(np.int64)
        np.testing.assert_array_equal(x[:, 0].numpy(), info.x[idx])
        np.testing.assert_array_equal(y.numpy(), info.y[idx])
        seen.append(idx)
    return np.concatenate(seen) if seen else np.zeros(0, np.int64)


def parent_holds_no_environment(path: Path) -> bool:
    """py-lmdb refuses a second open of a store in one process: opening succeeds only if none is open."""
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=8, create=False)
    except lmdb.Error:
        return False
    env.close()
    return True


@pytest.fixture
def loader_store(store_factory: Callable[..., StoreInfo]) -> StoreInfo:
    """1,000 samples (56 values, the last one partial)."""
    return store_factory(1000, seed=42)


def test_dataset_item_is_a_whole_batch(small_store: StoreInfo) -> None:
    ds = LmdbBatchDataset(small_store.path)
    assert len(ds) == 2000
    idx = np.array([1999, 0, 17, 18, 17])
    x, y = ds[idx]
    assert x.shape == (5, 1, 25, 25) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    np.testing.assert_array_equal(x[:, 0].numpy(), small_store.x[idx])
    np.testing.assert_array_equal(y.numpy(), small_store.y[idx])
    x0, y0 = ds[np.zeros(0, np.int64)]
    assert x0.shape == (0, 1, 25, 25) and y0.shape == (0,)
    with pytest.raises(IndexError):
        ds[np.array([2000])]
    ds.reader.close()  # one environment per store per process (py-lmdb): close before another opens
    flat = LmdbBatchDataset(small_store.path, add_channel=False)
    assert flat[idx][0].shape == (5, 25, 25)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((7,), np.uint8), ((3, 4, 4), np.float16), ((2,), np.int64), ((5,), np.uint16)]
)
def test_dataset_other_shapes_and_dtypes(
    store_factory: Callable[..., StoreInfo], shape: tuple[int, ...], dtype: type
) -> None:
    info = store_factory(100, seed=1, shape=shape, dtype=dtype)
    ds = LmdbBatchDataset(info.path)
    idx = np.array([99, 3, 50])
    x, _ = ds[idx]
    # a channel axis is added to 1-D and 2-D samples; 3-D samples (C, H, W) have one
    assert x.shape == ((3, 1, *shape) if len(shape) < 3 else (3, *shape)) == ds.batch_shape(3)
    assert x.numpy().dtype == np.dtype(dtype)
    np.testing.assert_array_equal(x.numpy().reshape(3, *shape), info.x[idx])


def test_dataset_closes_a_given_reader(small_store: StoreInfo) -> None:
    r = open_reader(small_store.path)
    ds = LmdbBatchDataset(r)
    assert ds.reader is r and r._h is None
    assert parent_holds_no_environment(small_store.path)
    np.testing.assert_array_equal(ds.labels.numpy(), small_store.y)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("shuffle", ["random", "block"])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_loader_reads_every_sample_once(loader_store: StoreInfo, workers: int, shuffle: str) -> None:
    cfg = LoaderConfig(batch_size=64, shuffle=shuffle, workers=workers, persistent_workers=False, seed=3)
    ds = LmdbBatchDataset(StoreReader(loader_store.path))
    sampler = epoch_sampler(ds, cfg)
    ds.reader.open()  # even a reader left open by the caller ...
    loader = make_loader(ds, sampler, cfg)
    if workers:
        assert ds.reader._h is None  # ... is closed before any worker starts
        assert parent_holds_no_environment(loader_store.path)
    seen = collect(loader, loader_store)
    assert len(seen) == 1000
    np.testing.assert_array_equal(np.sort(seen), np.arange(1000))
    # the batches arrive in the sampler's order, whatever the number of workers
    np.testing.assert_array_equal(seen, np.concatenate(sampler.batches()))
    if workers:
        assert ds.reader._h is None and parent_holds_no_environment(loader_store.path)


def test_plain_dataloader_with_an_open_reader_in_the_parent(loader_store: StoreInfo) -> None:
    """Without make_loader the parent's environment crosses the fork; the workers must open their own."""
    ds = LmdbBatchDataset(loader_store.path)
    ds[np.array([0, 1])]  # the parent reads: its environment is open now
    assert ds.reader._h is not None
    sampler = EpochBatchSampler(np.arange(1000), 100, seed=9)
    loader = torch.utils.data.DataLoader(
        ds, sampler=sampler, batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    seen = collect(loader, loader_store)
    np.testing.assert_array_equal(seen, sampler.epoch_order())
    x, _ = ds[np.array([999])]  # the parent's environment still works
    assert int(x[0, 0, 0, 0]) == 999


def test_loader_over_a_split(loader_store: StoreInfo) -> None:
    cfg = LoaderConfig(batch_size=50, shuffle="block", workers=2, persistent_workers=False)
    ds = LmdbBatchDataset(loader_store.path)
    subset = np.flatnonzero(loader_store.y != 2)
    seen = collect(make_loader(ds, epoch_sampler(ds, cfg, subset), cfg), loader_store)
    np.testing.assert_array_equal(np.sort(seen), subset)


def test_persistent_workers_over_two_epochs(loader_store: StoreInfo) -> None:
    cfg = LoaderConfig(batch_size=100, workers=2, persistent_workers=True, prefetch=1)
    ds = LmdbBatchDataset(loader_store.path)
    sampler = epoch_sampler(ds, cfg)
    loader = make_loader(ds, sampler, cfg)
    orders = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = collect(loader, loader_store)
        np.testing.assert_array_equal(seen, sampler.epoch_order())
        np.testing.assert_array_equal(np.sort(seen), np.arange(1000))
        orders.append(seen)
    assert not np.array_equal(orders[0], orders[1])
    assert parent_holds_no_environment(loader_store.path)


@pytest.mark.parametrize(("context", "workers"), [("fork", 2), ("spawn", 1)])  # spawn: slow to start
def test_multiprocessing_contexts(store_factory: Callable[..., StoreInfo], context: str, workers: int) -> None:
    info = store_factory(300, seed=4)
    cfg = LoaderConfig(batch_size=50, workers=workers, persistent_workers=False, multiprocessing_context=context)
    ds = LmdbBatchDataset(info.path)
    sampler = epoch_sampler(ds, cfg)
    seen = collect(make_loader(ds, sampler, cfg), info)
    np.testing.assert_array_equal(seen, sampler.epoch_order())
    np.testing.assert_array_equal(np.sort(seen), np.arange(300))


def test_balanced_loader(store_factory: Callable[..., StoreInfo]) -> None:
    info = store_factory(1500, seed=5, p=[0.7, 0.2, 0.05, 0.04, 0.01])
    ds = LmdbBatchDataset(info.path)
    with StoreReader(info.path) as r:
        class_indices = [r.class_indices(c) for c in range(5)]
    sampler = BalancedBatchSampler(class_indices, 200, num_batches=10, seed=2)
    cfg = LoaderConfig(batch_size=200, workers=2, persistent_workers=False)
    seen = collect(make_loader(ds, sampler, cfg), info)
    assert len(seen) == 2000
    share = np.bincount(info.y[seen], minlength=5) / len(seen)
    np.testing.assert_allclose(share, 0.2, atol=0.04)


def test_label_table_stays_compact(small_store: StoreInfo) -> None:
    """Workers share the store's uint8 label table (50 MB at 50M samples), not an int64 copy (400 MB)."""
    ds = LmdbBatchDataset(small_store.path)
    assert ds.labels.dtype == torch.uint8 and ds.labels.numel() == len(small_store.y)
    _, y = ds[np.array([5, 3, 1999])]
    assert y.dtype == torch.int64
    assert y.tolist() == small_store.y[[5, 3, 1999]].tolist()


def test_channel_first_samples_through_reused_buffers(store_factory: Callable[..., StoreInfo]) -> None:
    """(3, 16, 16) samples come as (N, 3, 16, 16) batches, with no extra channel axis, through the feed's
    reusable shared-memory slots (shaped by the dataset's layout)."""
    info = store_factory(640, seed=5, shape=(3, 16, 16))
    ds = LmdbBatchDataset(info.path)
    assert ds.batch_shape(64) == (64, 3, 16, 16)
    cfg = LoaderConfig(batch_size=64, workers=2, persistent_workers=False)
    loader = make_loader(ds, epoch_sampler(ds, cfg), cfg)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert loader.feed.source.layout.item_shape == (3, 16, 16)
    seen = []
    for x, y in loader:
        assert x.shape == (len(y), 3, 16, 16) and x.dtype == torch.float32
        idx = x[:, 0, 0, 0].numpy().astype(np.int64)
        np.testing.assert_array_equal(x.numpy(), info.x[idx])
        np.testing.assert_array_equal(y.numpy(), info.y[idx])
        seen.append(idx)
        del x, y  # as a training loop does: the slot can be reused
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(640))
    assert loader.feed.came == {"slot": len(seen), "sent": 0, "here": 0}  # every batch through a reused slot


class Doubled(LmdbBatchDataset):
    """Changes the batch in place (it stays in the reused buffer)."""

    def __getitem__(self, indices):  # type: ignore[no-untyped-def]
        x, y = super().__getitem__(indices)
        x[:, :, :, 1:] *= 2
        return x, y


class Cropped(LmdbBatchDataset):
    """Returns a view of the buffer (a crop) and one more item per batch, from the indices it was given."""

    def __getitem__(self, indices):  # type: ignore[no-untyped-def]
        x, y = super().__getitem__(indices)
        return x[:, :, :, :5], y, torch.as_tensor(np.asarray(indices) % 7)


@pytest.mark.parametrize("kind", ["doubled", "cropped"])
def test_a_subclass_overriding_getitem_works_with_workers_and_reused_buffers(small_store: StoreInfo, kind: str) -> None:
    """Issue 26: a subclass's own ``__getitem__`` saw slot tuples ("too many values to unpack")."""
    cls = Doubled if kind == "doubled" else Cropped
    cfg = LoaderConfig(batch_size=100, workers=2, multiprocessing_context="fork")
    loader = make_loader(cls(small_store.path), EpochBatchSampler(np.arange(len(small_store.y)), 100), cfg)
    for _ in range(2):
        kept = list(loader)  # every batch kept: a reused buffer under one of them would show
        seen = []
        for item in kept:
            x, y = item[0], item[1]
            idx = x[:, 0, 0, 0].numpy().astype(np.int64)
            np.testing.assert_array_equal(y.numpy(), small_store.y[idx])
            want = small_store.x[idx]
            if kind == "doubled":
                want = np.concatenate([want[:, :, :1], want[:, :, 1:] * 2], axis=2)
                np.testing.assert_array_equal(x[:, 0].numpy(), want)
            else:
                np.testing.assert_array_equal(x[:, 0].numpy(), want[:, :, :5])
                np.testing.assert_array_equal(item[2].numpy(), idx % 7)
            seen.append(idx)
        assert sorted(np.concatenate(seen).tolist()) == list(range(len(small_store.y)))
    if kind == "doubled":  # changed in place: still delivered through the reused slots
        assert loader.feed.came["slot"] > 0 and loader.feed.came["sent"] == 0
    else:  # other shapes and items: sent as they are
        assert loader.feed.came["sent"] == 2 * len(kept)


def _keep(queue, out) -> None:  # type: ignore[no-untyped-def]
    """In a child: take 20 batches off the queue, keep them, then send back the sample numbers they hold."""
    kept = [queue.get() for _ in range(20)]
    out.put([x[:, 0, 0, 0].round().long().tolist() for x in kept])


def test_a_batch_sent_to_another_process_stays_intact_when_its_slot_is_reused(small_store: StoreInfo) -> None:
    """Issue 33: no patch of torch's pickling.  A batch pickled to another process (a torch.multiprocessing queue)
    is copied by torch's own reducer into a segment of its own, as for any tensor not in torch's shared memory;
    the slot it came from is reused for later batches while the child still holds the copy."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("fork")
    queue, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_keep, args=(queue, out))
    child.start()
    loader = make_loader(LmdbBatchDataset(small_store.path), EpochBatchSampler(np.arange(2000), 100, shuffle="none"),
                         LoaderConfig(workers=2))  # fmt: skip
    for x, _ in loader:
        queue.put(x)
        del x
    got = out.get(timeout=60)
    child.join(60)
    assert sum(loader.feed.came.values()) == 20 and loader.feed.came["slot"] > loader.feed.slots.n  # slots reused
    assert got == [list(range(k * 100, (k + 1) * 100)) for k in range(20)]


class Paired(LmdbBatchDataset):
    """Reads twice per batch (pairs, mixup, contrastive views): the batch and the samples after it."""

    def __getitem__(self, indices):  # type: ignore[no-untyped-def]
        x1, y1 = super().__getitem__(indices)
        x2, y2 = super().__getitem__((np.asarray(indices) + 1) % len(self))
        return x1, x2, y1, y2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_subclass_reading_twice_gets_every_read_as_read(small_store: StoreInfo, workers: int) -> None:
    """Issue 39: both reads landed in the reader's slot (the second read in both results); with no workers a
    result holding the slot's memory was overwritten by the next batch."""
    cfg = LoaderConfig(batch_size=100, workers=workers, multiprocessing_context="fork")
    kept = list(make_loader(Paired(small_store.path), EpochBatchSampler(np.arange(2000), 100), cfg))
    seen = []
    for x1, x2, y1, y2 in kept:  # every batch kept: a reused slot under one of them would show
        idx = x1[:, 0, 0, 0].numpy().astype(np.int64)
        after = (idx + 1) % 2000
        np.testing.assert_array_equal(x1[:, 0].numpy(), small_store.x[idx])
        np.testing.assert_array_equal(x2[:, 0].numpy(), small_store.x[after])
        assert np.array_equal(y1.numpy(), small_store.y[idx]) and np.array_equal(y2.numpy(), small_store.y[after])
        seen.append(idx)
    assert sorted(np.concatenate(seen).tolist()) == list(range(2000))


MASK = np.zeros(256, bool)
MASK[[3, 100, 200]] = True


@pytest.mark.parametrize("bad", [MASK, [10.7, 20.2], torch.tensor(MASK)], ids=["mask", "floats", "tensor_mask"])
def test_masks_and_float_indices_are_refused_as_the_reader_refuses_them(small_store: StoreInfo, bad: Any) -> None:
    """Issue 39: a 256-long mask with 3 True read 256 samples numbered 0 and 1; ``[10.7, 20.2]`` read 10 and 20."""
    ds = LmdbBatchDataset(small_store.path)
    want = "boolean mask" if np.asarray(bad).dtype == bool else "integer sample indices"
    with pytest.raises(ValueError, match=want):
        ds[bad]
    cfg = LoaderConfig(workers=0)
    with pytest.raises(ValueError, match=want):
        next(iter(make_loader(ds, [bad], cfg)))  # a batch sampler's batch
    with pytest.raises(ValueError, match=want):
        make_loader(small_store.path, config=cfg, indices=bad)
    with pytest.raises(ValueError, match=want):
        EpochBatchSampler(bad, 10)
    got = ds[torch.tensor([10, 20])][0]  # integer tensors are sample numbers as they are
    np.testing.assert_array_equal(got[:, 0].numpy(), small_store.x[[10, 20]])
