"""Reusable shared-memory batch buffers (``lmdbstore.loader.buffers`` through ``make_loader``): real DataLoader
workers, real stores.  Every batch must hold exactly the samples its indices name, also when the consumer
keeps batches (or numpy arrays of them) while the loader goes on, across epochs, with spawn, and with two
loaders of one dataset; in a plain training loop every batch must come through a reused buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import StoreInfo

from lmdbstore.config import LoaderConfig
from lmdbstore.loader.buffers import EXTRA_SLOTS, BufferSpec
from lmdbstore.loader.dataset import BufferedLoader, LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler

BATCH = 96


def _loader(info: StoreInfo, **cfg):  # type: ignore[no-untyped-def]
    ds = LmdbBatchDataset(info.path)
    sampler = EpochBatchSampler(np.arange(len(ds)), BATCH, shuffle="random", seed=3)
    cfg.setdefault("workers", 2)
    cfg.setdefault("multiprocessing_context", "fork")
    return make_loader(ds, sampler, LoaderConfig(batch_size=BATCH, **cfg)), sampler.batches(0)


def pinned(loader: BufferedLoader, epoch: int = 0):  # type: ignore[no-untyped-def]
    """A pass over ``loader`` in the order of ``epoch`` (without the pin every pass is the next epoch)."""
    loader.sampler.set_epoch(epoch)
    return iter(loader)


def _check(info: StoreInfo, x: torch.Tensor, y: torch.Tensor, idx: np.ndarray) -> None:
    assert x.shape == (len(idx), 1, 25, 25)
    np.testing.assert_array_equal(x.numpy()[:, 0], info.x[idx])
    np.testing.assert_array_equal(y.numpy(), info.y[idx])


def test_a_training_loop_gets_every_batch_right_through_reused_buffers(small_store: StoreInfo) -> None:
    loader, expected = _loader(small_store)
    assert isinstance(loader, BufferedLoader)
    for _ in range(2):  # persistent workers: the second epoch reuses the first epoch's buffers
        n = 0
        for (x, y), idx in zip(pinned(loader), expected, strict=True):
            _check(small_store, x, y, idx)
            n += 1
        assert n == len(expected) == -(-2000 // BATCH)
    assert loader.reuse_counts() == (2 * len(expected), 0)  # no batch needed a fresh segment


def test_kept_batches_and_numpy_views_are_never_overwritten(small_store: StoreInfo) -> None:
    loader, expected = _loader(small_store, persistent_workers=False)
    kept = list(pinned(loader))  # more batches than buffers: the rest must come through fresh segments
    arrays = []
    for i, (x, _) in enumerate(pinned(loader)):
        if i % 3 == 0:
            arrays.append((i, x.numpy()[:4, 0]))  # only a numpy view survives the loop variable
    for (x, y), idx in zip(kept, expected, strict=True):
        _check(small_store, x, y, idx)
    for i, a in arrays:
        np.testing.assert_array_equal(a, small_store.x[expected[i][:4]])
    slots = 2 * (LoaderConfig().prefetch_factor + EXTRA_SLOTS)
    reused, fresh = loader.reuse_counts()  # the last epoch's buffers: some reused, some held by `arrays`
    assert reused + fresh == len(expected) and reused >= len(expected) - len(arrays) - slots


def test_an_abandoned_epoch_frees_its_buffers_for_the_next(small_store: StoreInfo) -> None:
    loader, expected = _loader(small_store)
    for stop in (0, 3, 7):
        for i, _ in enumerate(pinned(loader)):
            if i == stop:
                break  # the workers had batches in flight: their slots belong to a dead iteration
        for (x, y), idx in zip(pinned(loader), expected, strict=True):
            _check(small_store, x, y, idx)
    reused, fresh = loader.reuse_counts()
    assert fresh == 0 and reused >= 3 * len(expected)


def test_spawned_workers_share_the_buffers(small_store: StoreInfo) -> None:
    loader, expected = _loader(small_store, multiprocessing_context="spawn")
    for (x, y), idx in zip(pinned(loader), expected, strict=True):
        _check(small_store, x, y, idx)
    assert loader.reuse_counts() == (len(expected), 0)


def test_two_loaders_of_one_dataset_have_their_own_buffers(small_store: StoreInfo) -> None:
    ds = LmdbBatchDataset(small_store.path)
    cfg = LoaderConfig(batch_size=BATCH, workers=2, multiprocessing_context="fork")
    a = EpochBatchSampler(np.arange(0, 1000), BATCH, shuffle="random", seed=1)
    b = EpochBatchSampler(np.arange(1000, 2000), BATCH, shuffle="none")
    la, lb = make_loader(ds, a, cfg), make_loader(ds, b, cfg)
    assert ds.buffers is None  # the loaders' copies hold them
    for ((xa, ya), ia), ((xb, yb), ib) in zip(
        zip(la, a.batches(0), strict=True), zip(lb, b.batches(0), strict=True), strict=True
    ):
        _check(small_store, xa, ya, ia)
        _check(small_store, xb, yb, ib)


def test_short_last_batch_and_oversized_batches(small_store: StoreInfo) -> None:
    ds = LmdbBatchDataset(small_store.path)
    sampler = EpochBatchSampler(np.arange(len(ds)), BATCH, shuffle="none")
    loader = make_loader(ds, sampler, LoaderConfig(batch_size=BATCH, workers=1, multiprocessing_context="fork"))
    for (x, y), idx in zip(loader, sampler.batches(0), strict=True):
        _check(small_store, x, y, idx)
    assert len(idx) == 2000 % BATCH and loader.reuse_counts() == (-(-2000 // BATCH), 0)
    sampler.batch_size = BATCH * 3  # a sampler that outgrows the buffers: fresh segments, still right
    batches = sampler.batches(1)
    for (x, y), idx in zip(loader, batches, strict=True):
        _check(small_store, x, y, idx)
    assert loader.reuse_counts()[1] == len(batches)


@pytest.mark.parametrize("cfg", [{"reuse_buffers": False}, {"workers": 0}])
def test_without_reuse_or_workers_every_batch_is_a_fresh_tensor(small_store: StoreInfo, cfg: dict) -> None:  # type: ignore[type-arg]
    loader, expected = _loader(small_store, **cfg)
    assert loader.buffer_spec is None
    kept = list(pinned(loader))
    for (x, y), idx in zip(kept, expected, strict=True):
        _check(small_store, x, y, idx)
    assert loader.reuse_counts() == (0, 0)


def test_no_room_for_buffers_warns_and_falls_back_to_fresh_segments(small_store: StoreInfo) -> None:
    loader, expected = _loader(small_store)
    spec = loader.buffer_spec
    loader.buffer_spec = BufferSpec(spec.workers, spec.slots, (1 << 38, 1), spec.dtype)  # 1 TiB: refused
    with pytest.warns(RuntimeWarning, match="fresh segment"):
        for (x, y), idx in zip(pinned(loader), expected, strict=True):
            _check(small_store, x, y, idx)
    assert loader.reuse_counts() == (0, 0)
