"""Epoch orders and the loader over a set of stores: random, block, window and balanced orders (as the trainer
builds them) cover the set exactly once per epoch on one rank and across two, block and window keep each
store's packed values whole, batches come grouped by store, real DataLoader workers read the set, and a
ConcatDataset of two datasets reads as the set.  Real stores; first pixel = index in the set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SET_CLASSES, SetInfo
from torch.utils.data import ConcatDataset, TensorDataset

from lmdbstore import LoaderConfig, open_reader
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.choose import make_sampler_for
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.sets import SetBatches, SetSpace
from lmdbstore.loader.window import WindowBatchSampler
from lmdbstore.training.data import read_store

SPV = 18


def _quiet(_msg: str) -> None:
    pass


def _sampler(three: SetInfo, shuffle: str, rank: int = 0, world: int = 1, **kw: object) -> SetBatches:
    data = read_store(three.paths)
    cfg = LoaderConfig(batch_size=64, shuffle=shuffle, seed=3, **kw)  # type: ignore[arg-type]
    sampler = make_sampler_for(
        data.reader, data.meta, data.labels, np.arange(len(three.x)), cfg, rank=rank, world_size=world, say=_quiet
    )
    assert isinstance(sampler, SetBatches)
    return sampler


def test_the_padded_space_starts_every_store_on_a_value() -> None:
    space = SetSpace([1000, 517, 263], SPV)
    assert space.padded.tolist() == [0, 1008, 1530, 1800]  # 1000 -> 56 values, 517 -> 29 values
    idx = np.arange(1780)
    padded = space.to_padded(idx)
    assert (padded[[0, 1000, 1517]] % SPV == 0).all()  # each store's first sample starts a value
    np.testing.assert_array_equal(space.to_set(padded), idx)


@pytest.mark.parametrize("shuffle", ["random", "block", "window"])
def test_every_sample_once_per_epoch_on_one_rank_and_across_two(three: SetInfo, shuffle: str) -> None:
    extra = {"window_mb": 1} if shuffle == "window" else {}
    reader = open_reader(three.paths)
    for epoch in (0, 1):
        one = _sampler(three, shuffle, **extra)
        one.set_epoch(epoch)
        batches = list(one)
        assert len(batches) == len(one)
        for b in batches:  # grouped by store, in store order
            assert (np.diff(reader.store_of(b)) >= 0).all()
        np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(1780))
        shares = []
        for rank in (0, 1):
            s = _sampler(three, shuffle, rank, 2, **extra)
            s.set_epoch(epoch)
            shares.append(np.concatenate(list(s)))
        assert not set(shares[0]) & set(shares[1])
        np.testing.assert_array_equal(np.sort(np.concatenate(shares)), np.arange(1780))


def _value_batches(reader: object, batches: list[np.ndarray]) -> dict[tuple[int, int], list[int]]:
    """Per packed value of a store (store, value in that store), the batches holding its samples."""
    where: dict[tuple[int, int], list[int]] = {}
    for k, b in enumerate(batches):
        store = reader.store_of(b)  # type: ignore[attr-defined]
        local_value = (b - reader.offsets[store]) // SPV  # type: ignore[attr-defined]
        for key in set(zip(store.tolist(), local_value.tolist(), strict=True)):
            where.setdefault(key, []).append(k)
    return where


def test_block_order_keeps_each_stores_values_whole(three: SetInfo) -> None:
    reader = open_reader(three.paths)
    # block_buffer=1: values whole in the epoch order, so a value's samples are in one batch or two in a row
    where = _value_batches(reader, list(_sampler(three, "block", block_buffer=1)))
    assert len(where) == sum(-(-n // SPV) for n in reader.counts)
    assert all(len(ks) <= 2 and ks[-1] - ks[0] <= 1 for ks in where.values()), where
    # grouping set indices // 18 instead would cut the later stores' values in two, far apart in the order
    naive = EpochBatchSampler(np.arange(1780), 64, shuffle="block", samples_per_value=SPV, block_buffer=1, seed=3)
    assert any(ks[-1] - ks[0] > 1 for ks in _value_batches(reader, list(naive)).values())


def test_window_read_ahead_covers_each_window_in_set_indices(three: SetInfo) -> None:
    sampler = _sampler(three, "window", window_mb=1)
    inner = sampler.inner
    assert isinstance(inner, WindowBatchSampler)
    plan = inner.plan()
    space = sampler.space
    assert space is not None
    order = plan.order()
    for w in range(len(plan.chunk_lo)):
        members = space.to_set(order[plan.window_starts[w] : plan.window_starts[w + 1]])
        lo, hi = space.to_set(plan.chunk_lo[w]), space.to_set(plan.chunk_hi[w] - 1) + 1
        covered = np.zeros(1780, bool)
        for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
            covered[a:b] = True
        assert covered[members].all()  # what the set's prefetch reads ahead holds the window's samples


def test_balanced_batches_draw_classes_by_name_across_stores(three: SetInfo) -> None:
    sampler = _sampler(three, "random", balanced=True)
    drawn = np.concatenate(list(sampler))
    names = three.names[drawn]
    counts = [int((names == c).sum()) for c in SET_CLASSES]
    assert min(counts) > 0.6 * max(counts)  # about equal, although "x" lives in one store only


def test_dataloader_workers_read_the_set_and_labels_match_names(three: SetInfo) -> None:
    ds = LmdbBatchDataset(three.paths)
    assert len(ds) == 1780
    sampler = _sampler(three, "random")
    seen = []
    for x, y in make_loader(ds, sampler, LoaderConfig(batch_size=64, workers=2)):
        idx = x[:, 0, 0, 0].numpy().astype(np.int64)
        np.testing.assert_array_equal(x[:, 0].numpy(), three.x[idx])
        np.testing.assert_array_equal(np.asarray(SET_CLASSES)[y.numpy()], three.names[idx])
        seen.append(idx)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(1780))


def test_concat_dataset_of_two_datasets_reads_as_the_set(three: SetInfo) -> None:
    concat = ConcatDataset([LmdbBatchDataset(three.paths[0]), LmdbBatchDataset(three.paths[1:])])
    sampler = EpochBatchSampler(np.arange(len(concat)), 100, shuffle="none")
    loader = make_loader(concat, sampler, LoaderConfig(batch_size=100, workers=1))
    xs = torch.cat([x for x, _ in loader])
    np.testing.assert_array_equal(xs[:, 0].numpy(), three.x)
    with pytest.raises(
        ValueError, match=r"dataset must be an LmdbBatchDataset, got ConcatDataset; .* LmdbBatchDataset\(\["
    ):
        make_loader(ConcatDataset([LmdbBatchDataset(three.paths[0]), TensorDataset(torch.zeros(3))]), sampler)
