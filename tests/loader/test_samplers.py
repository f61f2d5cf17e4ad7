"""Epoch orders and batch samplers: coverage, determinism, block locality, DDP sharding, balancing, splits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lmdbstore.loader.samplers import (
    BalancedBatchSampler,
    EpochBatchSampler,
    block_order,
    shard_batches,
    stratified_split,
)


def _cat(batches: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(batches) if batches else np.zeros(0, np.int64)


@pytest.mark.parametrize("shuffle", ["random", "block"])
def test_each_index_exactly_once_per_epoch(shuffle: str) -> None:
    indices = np.random.default_rng(0).choice(10_000, 3001, replace=False)  # a split: not 0..n-1
    s = EpochBatchSampler(indices, 128, shuffle=shuffle, samples_per_value=18, seed=7)
    orders = []
    for epoch in range(3):
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s) == -(-3001 // 128)
        assert all(b.dtype == np.int64 for b in batches)
        assert [len(b) for b in batches] == [128] * 23 + [3001 - 23 * 128]
        order = _cat(batches)
        np.testing.assert_array_equal(np.sort(order), np.sort(indices))
        orders.append(order)
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[1], orders[2])
    # same (seed, epoch): same order, from a fresh sampler too
    again = EpochBatchSampler(indices, 128, shuffle=shuffle, samples_per_value=18, seed=7)
    again.set_epoch(1)
    np.testing.assert_array_equal(_cat(list(again)), orders[1])
    other_seed = EpochBatchSampler(indices, 128, shuffle=shuffle, samples_per_value=18, seed=8)
    other_seed.set_epoch(1)
    assert not np.array_equal(_cat(list(other_seed)), orders[1])


def test_block_mode_touches_far_fewer_values() -> None:
    n, spv, bs = 18 * 1000, 18, 256
    idx = np.arange(n)
    rand = EpochBatchSampler(idx, bs, shuffle="random", samples_per_value=spv)
    block = EpochBatchSampler(idx, bs, shuffle="block", samples_per_value=spv, block_buffer=1)
    block4 = EpochBatchSampler(idx, bs, shuffle="block", samples_per_value=spv, block_buffer=4)

    def mean_values(s: EpochBatchSampler) -> float:
        return float(np.mean([len(np.unique(b // spv)) for b in s]))

    r, b1, b4 = mean_values(rand), mean_values(block), mean_values(block4)
    assert r > 200  # nearly one value per sample
    assert b1 <= bs / spv + 2  # whole values: ~15 per batch
    assert b4 <= 4 * bs / spv + 2
    assert b1 * 5 < r and b4 * 2 < r
    # block mode still mixes: a batch draws values from all over the store, not a run of neighbours,
    # and with block_buffer > 1 values are split across batches
    first = next(iter(block4))
    values = np.unique(first // spv)
    assert np.array_equal(first, np.sort(first))  # batches come sorted: runs are contiguous for the reader
    assert values.max() - values.min() > 10 * len(values)
    assert any(np.count_nonzero(first // spv == v) < spv for v in values)


def test_block_order_of_an_arbitrary_subset() -> None:
    rng = np.random.default_rng(3)
    subset = rng.choice(5000, 1234, replace=False)
    order = block_order(subset, 18, 64, 2, np.random.default_rng(0))
    np.testing.assert_array_equal(np.sort(order), np.sort(subset))
    assert block_order(np.zeros(0, np.int64), 18, 64, 2, rng).size == 0


def test_shuffle_none_keeps_order() -> None:
    s = EpochBatchSampler(np.arange(10), 4, shuffle="none")
    assert [b.tolist() for b in s] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("n", [0, 1, 5, 1000, 1001, 1023, 1024, 4097])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_batches_partition_the_epoch(n: int, world_size: int) -> None:
    bs = 64
    order = np.random.default_rng(n).permutation(n)
    shares = [shard_batches(order, bs, rank, world_size) for rank in range(world_size)]
    counts = {len(s) for s in shares}
    assert len(counts) == 1  # every rank runs the same number of steps
    if n:
        assert counts.pop() == -(-n // (bs * world_size))
    everything = _cat([b for s in shares for b in s])
    assert len(everything) == n  # disjoint (no index twice) ...
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))  # ... and complete
    assert all(len(b) <= bs for s in shares for b in s)
    if n >= world_size * bs:
        assert all(len(b) > 0 for s in shares for b in s)


@pytest.mark.parametrize("world_size", [2, 3])
def test_epoch_sampler_ranks_share_one_order(world_size: int) -> None:
    idx = np.arange(2000)
    samplers = [EpochBatchSampler(idx, 100, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
    for s in samplers:
        s.set_epoch(4)
    shares = [list(s) for s in samplers]
    assert len({len(s) for s in samplers}) == 1 and len(shares[0]) == len(samplers[0])
    everything = _cat([b for s in shares for b in s])
    np.testing.assert_array_equal(np.sort(everything), idx)


def test_shard_batches_rejects_bad_rank() -> None:
    for rank, ws in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match="rank"):
            shard_batches(np.arange(10), 4, rank, ws)


def test_drop_last() -> None:
    s = EpochBatchSampler(np.arange(1000), 64, drop_last=True)
    batches = list(s)
    assert len(batches) == len(s) == 15
    assert all(len(b) == 64 for b in batches)
    assert len(np.unique(_cat(batches))) == 960
    exact = EpochBatchSampler(np.arange(1024), 64, drop_last=True)
    assert len(list(exact)) == len(exact) == 16


def test_drop_last_with_several_ranks_keeps_step_counts_equal() -> None:
    # 15 samples, batch 4, 2 ranks: plain sharding gives batches of 4,4 (rank 0) and 4,3 (rank 1)
    for n in (15, 16, 17, 1000):
        samplers = [EpochBatchSampler(np.arange(n), 4, rank=r, world_size=2, drop_last=True) for r in range(2)]
        shares = [list(s) for s in samplers]
        assert len(shares[0]) == len(shares[1]) == len(samplers[0]) == len(samplers[1])
        assert all(len(b) == 4 for s in shares for b in s)
        assert len(np.unique(_cat([b for s in shares for b in s]))) == 8 * (n // 8)


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        EpochBatchSampler(np.arange(3), 0)
    with pytest.raises(ValueError, match="shuffle"):
        EpochBatchSampler(np.arange(3), 2, shuffle="sorted")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- balanced sampling


def test_balanced_sampler_equalises_imbalanced_classes() -> None:
    sizes = [5000, 500, 50, 5, 1000]
    start = np.cumsum([0, *sizes])
    class_indices = [np.arange(start[c], start[c + 1]) for c in range(5)]
    label_of = np.repeat(np.arange(5), sizes)
    s = BalancedBatchSampler(class_indices, 500, seed=1)
    assert len(s) == -(-sum(sizes) // 500)
    drawn = _cat(list(s))
    assert len(drawn) == len(s) * 500
    share = np.bincount(label_of[drawn], minlength=5) / len(drawn)
    np.testing.assert_allclose(share, 0.2, atol=0.03)
    assert set(drawn[label_of[drawn] == 3].tolist()) <= set(class_indices[3].tolist())
    # deterministic per (seed, epoch), different across epochs and ranks
    again = BalancedBatchSampler(class_indices, 500, seed=1)
    np.testing.assert_array_equal(_cat(list(again)), drawn)
    again.set_epoch(1)
    assert not np.array_equal(_cat(list(again)), drawn)
    rank1 = BalancedBatchSampler(class_indices, 500, seed=1, rank=1, world_size=2)
    assert not np.array_equal(next(iter(rank1)), next(iter(s)))


def test_balanced_sampler_weights_and_empty_classes() -> None:
    class_indices = [np.arange(0, 100), np.arange(100, 110), np.zeros(0, np.int64)]
    with pytest.raises(ValueError, match="'c'"):
        BalancedBatchSampler(class_indices, 32, class_names=["a", "b", "c"])
    s = BalancedBatchSampler(class_indices, 1000, weights=[3, 1, 0], num_batches=4)
    drawn = _cat(list(s))
    assert len(list(s)) == 4 and len(drawn) == 4000
    frac_b = np.mean(drawn >= 100)
    assert 0.2 < frac_b < 0.3
    for bad in ([1, 1], [1, -1, 0], [0, 0, 0]):
        with pytest.raises(ValueError, match="weights"):
            BalancedBatchSampler(class_indices, 32, weights=bad)
    with pytest.raises(ValueError, match="batch_size"):
        BalancedBatchSampler(class_indices[:2], 0)


# ----------------------------------------------------------------------------- splits


def test_stratified_split() -> None:
    rng = np.random.default_rng(2)
    labels = rng.choice(5, size=5000, p=[0.5, 0.3, 0.15, 0.0496, 0.0004])
    labels[:3] = 4  # make sure the rare class has a few members
    train, val = stratified_split(labels, 0.2, seed=3)
    assert len(np.intersect1d(train, val)) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), np.arange(5000))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(val) > 0)
    assert train.dtype == val.dtype == np.int64
    for c in range(5):
        n_c = int(np.sum(labels == c))
        n_val = int(np.sum(labels[val] == c))
        if n_c >= 2:
            assert 1 <= n_val <= n_c - 1
        assert abs(n_val - 0.2 * n_c) <= 1
    _, v2 = stratified_split(labels, 0.2, seed=3)
    np.testing.assert_array_equal(v2, val)
    _, v3 = stratified_split(labels, 0.2, seed=4)
    assert not np.array_equal(v3, val)
    t0, v0 = stratified_split(labels, 0.0)
    assert len(v0) == 0 and len(t0) == 5000
    with pytest.raises(ValueError, match="val_fraction"):
        stratified_split(labels, 1.0)
    te, ve = stratified_split(np.zeros(0, np.int64), 0.1)
    assert len(te) == len(ve) == 0


def _split_by_sorting(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The split as it was first written (one stable sort of the whole table): what every earlier run used."""
    import itertools

    labels = np.asarray(labels)
    rng = np.random.default_rng([seed, 0x5A17])
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.r_[True, labels[order][1:] != labels[order][:-1], True])
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        members = order[lo:hi]
        n_val = round(len(members) * val_fraction)
        if val_fraction > 0 and len(members) >= 2:
            n_val = min(max(n_val, 1), len(members) - 1)
        parts.append(rng.choice(members, size=n_val, replace=False))
    val = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    mask = np.ones(len(labels), bool)
    mask[val] = False
    return np.flatnonzero(mask), val


@pytest.mark.parametrize("dtype", ["u1", "u2", "i8", "i4"])
def test_stratified_split_keeps_the_split_of_earlier_versions(dtype: str) -> None:
    """The split made class by class (no sort of the table) is the sorted one's, draw for draw: runs keep it."""
    rng = np.random.default_rng(11)
    cases = [
        rng.choice(5, size=60_000, p=[0.5, 0.3, 0.15, 0.0496, 0.0004]),  # a tiny class; big ones past 10,000
        np.repeat(np.arange(4), [3, 1, 20_000, 7]),  # sorted by class, one class of one sample
        np.zeros(30_001, np.int64),  # one class
        np.array([2, 2]),
        np.array([9]),
    ]
    for labels in cases:
        labels = labels.astype(dtype)
        for frac, seed in ((0.1, 0), (0.25, 3), (0.0, 1), (0.999, 2)):
            train, val = stratified_split(labels, frac, seed)
            ref_train, ref_val = _split_by_sorting(labels, frac, seed)
            np.testing.assert_array_equal(val, ref_val)
            np.testing.assert_array_equal(train, ref_train)
            assert train.dtype == val.dtype == np.int64


def test_random_order_is_the_permutation_of_earlier_versions() -> None:
    """The random epoch order, shuffled in place, is ``indices[rng.permutation(n)]`` as before (resumes)."""
    from lmdbstore.loader.orders import epoch_rng

    idx = np.random.default_rng(0).choice(100_000, 30_001, replace=False)
    s = EpochBatchSampler(idx, 512, shuffle="random", seed=7)
    for epoch in (0, 3):
        want = np.asarray(idx, np.int64)[epoch_rng(7, epoch).permutation(len(idx))]
        np.testing.assert_array_equal(s.epoch_order(epoch), want)


def _peak_bytes(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the most memory numpy held at once meanwhile above what it held before (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_building_the_split_and_orders_holds_no_second_copy_of_the_index_space() -> None:
    """Issue 36: at scale the split peaked at 2.7x what it returns and a random epoch at 2x its order; each now
    needs little more than what it keeps (8 bytes a sample)."""
    n = 4_000_000
    labels = (np.arange(n) * 7919 % 5).astype(np.uint8)
    (train, val), peak = _peak_bytes(lambda: stratified_split(labels, 0.1, 0))
    assert peak <= 1.25 * (train.nbytes + val.nbytes)
    s = EpochBatchSampler(train, 4096, shuffle="random", seed=0)
    order, peak = _peak_bytes(lambda: s.epoch_order(0))
    assert peak <= 1.05 * order.nbytes
    b = EpochBatchSampler(train, 4096, shuffle="block", samples_per_value=36, seed=0)
    _, peak = _peak_bytes(lambda: next(iter(b)))
    assert peak <= 0.5 * train.nbytes  # the block plan holds pieces of values (36 samples), not samples


@pytest.mark.parametrize("bad", [np.ones(8, bool), [1.5, 2.0]], ids=["mask", "floats"])
def test_samplers_take_sample_numbers_only(bad: Any) -> None:
    """Issue 39: one index rule (the reader's): a boolean mask or floats are refused, never cast to 0/1 or truncated."""
    want = "boolean mask" if np.asarray(bad).dtype == bool else "integer sample indices"
    for make in (lambda: EpochBatchSampler(bad, 4), lambda: BalancedBatchSampler([bad, [1, 2]], 4)):
        with pytest.raises(ValueError, match=want):
            make()
