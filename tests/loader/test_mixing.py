"""Per-store weights (lmdbstore.loader.mixing): every epoch takes exactly each store's share, draws a store's
samples without repeats until all were drawn, is deterministic and sharded like every order; orders that
cannot keep the shares are refused; the weights reach make_loader, the feeds and the trainer's sampler."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import SET_CLASSES, SetInfo, build_set

from lmdbstore import LoaderConfig, MixedBatchSampler, open_reader, store_parts
from lmdbstore.config import FeedConfig
from lmdbstore.loader.choose import make_sampler_for
from lmdbstore.loader.mixing import mix_counts

PARTS = [np.arange(0, 1000), np.arange(1000, 1517), np.arange(1517, 1780)]


@pytest.fixture(scope="module")
def mixed_set(tmp_path_factory: pytest.TempPathFactory) -> SetInfo:
    return build_set(tmp_path_factory.mktemp("mixset"))


def _shares(order: np.ndarray) -> list[int]:
    return [int(np.isin(order, p).sum()) for p in PARTS]


def test_counts_split_the_epoch_by_largest_remainder() -> None:
    assert mix_counts([0.7, 0.3], 10).tolist() == [7, 3]
    assert mix_counts([1, 1, 1], 10).tolist() == [4, 3, 3]
    assert mix_counts([2, 0, 1], 1780).sum() == 1780
    for bad in ([], [0, 0], [-1, 2], [float("nan"), 1]):
        with pytest.raises(ValueError, match="weights"):
            mix_counts(bad, 10)


@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], [0.2, 0.2, 0.6], [1, 0, 0]])
def test_every_epoch_takes_exactly_each_share(weights: list[float]) -> None:
    s = MixedBatchSampler(PARTS, weights, 64, seed=3)
    want = mix_counts(weights, 1780).tolist()
    for epoch in range(4):
        batches = s.batches(epoch)
        assert len(batches) == len(s) == -(-1780 // 64)
        order = np.concatenate(batches)
        assert len(order) == 1780 and _shares(order) == want
        assert all((np.diff(b) >= 0).all() for b in batches)  # grouped by store
    assert [b.tolist() for b in s.batches(1)] == [
        b.tolist() for b in MixedBatchSampler(PARTS, weights, 64, seed=3).batches(1)
    ]
    assert s.batches(0)[0].tolist() != s.batches(1)[0].tolist()


@pytest.mark.parametrize(
    "weights", [[1e308, 1e308, 1e308], [1e308, 5e307, 0], [5e-324, 5e-324, 1e-323], [1.7e308, 1, 0]]
)
def test_weights_whose_sum_overflows_keep_their_shares(weights: list[float]) -> None:
    """Each weight finite, their sum not (or subnormal): normalized by the largest first, so every epoch still
    has all its samples in their shares, and len() says what is drawn (issue 34 #2: 2 samples an epoch)."""
    w = np.asarray(weights) / max(weights)
    want = np.floor(w / w.sum() * 1780).astype(int)
    counts = mix_counts(weights, 1780)
    assert counts.sum() == 1780 and (np.abs(counts - want) <= 1).all()
    s = MixedBatchSampler(PARTS, weights, 64, seed=3)
    batches = s.batches(0)
    assert len(batches) == len(s) == -(-1780 // 64) and sum(len(b) for b in batches) == 1780
    assert _shares(np.concatenate(batches)) == counts.tolist()
    assert np.isclose(s.weights.sum(), 1) and np.isfinite(s.weights).all()
    assert LoaderConfig(weights=tuple(weights)).weights == tuple(weights)
    for bad in ([float("inf"), 1.0], [1e308, float("nan")], [0.0, 0.0], [-1e308, 1e308]):
        with pytest.raises(ValueError, match="weights"):
            LoaderConfig(weights=tuple(bad))
        with pytest.raises(ValueError, match="weights"):
            mix_counts(bad, 10)


def test_balanced_class_weights_whose_sum_overflows() -> None:
    from lmdbstore.loader.samplers import BalancedBatchSampler

    s = BalancedBatchSampler([np.arange(0, 10), np.arange(10, 20)], 1000, weights=[1e308, 1e308], num_batches=3)
    assert s.weights.tolist() == [0.5, 0.5]
    drawn = np.concatenate(list(s))
    assert len(drawn) == 3000 and 1300 < (drawn < 10).sum() < 1700  # both classes, about half each
    for bad in ([float("inf"), 1], [0, 0], [1, -1], [1]):
        with pytest.raises(ValueError, match="weights"):
            BalancedBatchSampler([np.arange(0, 10), np.arange(10, 20)], 10, weights=bad)


def test_a_store_is_drawn_without_repeats_until_used_up() -> None:
    s = MixedBatchSampler(PARTS, [0.1, 0.1, 0.8], 100, epoch_samples=1000)
    k = s.counts.tolist()  # [100, 100, 800]: part 0 (1000) downsampled, part 2 (263) upsampled
    stream0 = np.concatenate([s.draw(0, e) for e in range(10)])
    assert sorted(stream0.tolist()) == PARTS[0].tolist()  # 10 epochs of 100: every sample exactly once
    for e in range(3):
        counts = Counter(s.draw(2, e).tolist())
        assert len(counts) == 263 and sum(counts.values()) == k[2]
        assert max(counts.values()) - min(counts.values()) <= 2  # 800 / 263: three or four times each, +-1
    first = np.concatenate([s.draw(2, e) for e in range(263)])  # 263 epochs of 800 = 800 whole permutations
    assert Counter(first.tolist()) == dict.fromkeys(PARTS[2].tolist(), 800)


def test_ranks_share_one_epoch_and_resume_inside_it() -> None:
    whole = MixedBatchSampler(PARTS, [0.5, 0.3, 0.2], 50, seed=1)
    ranks = [MixedBatchSampler(PARTS, [0.5, 0.3, 0.2], 50, seed=1, rank=r, world_size=2) for r in range(2)]
    got = np.concatenate([b for r in ranks for b in r.batches(2)])
    assert sorted(got.tolist()) == sorted(whole.epoch_order(2).tolist())
    it = iter(whole)
    first = [next(it).tolist() for _ in range(3)]
    state = whole.state_dict()
    again = MixedBatchSampler(PARTS, [0.5, 0.3, 0.2], 50, seed=1)
    again.load_state_dict(state)
    rest = [b.tolist() for b in again]
    assert first + rest == [b.tolist() for b in whole.batches(0)] and state["kind"] == "mixed"


def test_orders_that_cannot_keep_the_shares_are_refused() -> None:
    for kw in ({"shuffle": "block"}, {"shuffle": "window"}, {"balanced": True}):
        with pytest.raises(ValueError, match="weights"):
            LoaderConfig(weights=(0.5, 0.5), **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shuffle"):
        FeedConfig(weights=(0.5, 0.5), shuffle="none")
    assert FeedConfig(weights=[1, 2], split="val").order == "random"  # type: ignore[arg-type]
    assert LoaderConfig(weights=[1, 2]).weights == (1.0, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weights"):
        LoaderConfig(weights=(0, 0))
    with pytest.raises(ValueError, match="2 numbers for 3 stores"):
        MixedBatchSampler(PARTS, [1, 1], 10)
    with pytest.raises(ValueError, match="no samples"):
        MixedBatchSampler([PARTS[0], np.zeros(0, np.int64)], [1, 1], 10)


def test_the_sampler_for_a_set_takes_its_weights(mixed_set: SetInfo) -> None:
    reader = open_reader(mixed_set.paths)
    parts = store_parts(reader)
    assert [len(p) for p in parts] == [1000, 517, 263]
    labels = reader.labels()
    idx = np.arange(0, len(reader), 2)  # a split: every other sample
    s = make_sampler_for(reader, reader.meta, labels, idx, LoaderConfig(batch_size=64, weights=(1, 1, 2)))
    order = np.concatenate(list(s))
    assert len(order) == len(idx) and set(order.tolist()) <= set(idx.tolist())
    assert _shares(order) == mix_counts([1, 1, 2], len(idx)).tolist()
    reader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_make_loader_over_a_set_with_weights(mixed_set: SetInfo, workers: int) -> None:
    from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader

    ds = LmdbBatchDataset(mixed_set.paths)
    sampler = MixedBatchSampler(store_parts(ds.reader), [0.6, 0.3, 0.1], 128, epoch_samples=1500)
    cfg = LoaderConfig(batch_size=128, workers=workers, multiprocessing_context="fork")
    loader = make_loader(ds, sampler, cfg)
    for _ in range(2):
        seen = []
        for x, y in loader:
            idx = np.rint(x[:, 0, 0, 0].numpy()).astype(np.int64)
            np.testing.assert_array_equal(x[:, 0].numpy(), mixed_set.x[idx])
            assert [SET_CLASSES[c] for c in y.tolist()] == mixed_set.names[idx].tolist()
            seen.append(idx)
        assert _shares(np.concatenate(seen)) == [900, 450, 150]


def test_the_feeds_take_weights_over_a_set(mixed_set: SetInfo) -> None:
    from lmdbstore.feed.opening import loader_config, open_feed

    feed = open_feed(mixed_set.paths, loader_config(None, {"batch_size": 100, "workers": 2, "weights": [0.5, 0.25, 0.25],
                                                         "multiprocessing_context": "fork"}))  # fmt: skip
    for _ in range(2):
        feed.begin()
        seen = []
        while True:
            try:
                x, y = feed.next()
            except StopIteration:
                break
            idx = np.rint(x[:, 0, 0, 0]).astype(np.int64)
            np.testing.assert_array_equal(x[..., 0], mixed_set.x[idx])
            assert [SET_CLASSES[c] for c in y.tolist()] == mixed_set.names[idx].tolist()
            seen.append(idx)
        assert _shares(np.concatenate(seen)) == [890, 445, 445]
    feed.close()


def test_parts_take_sample_numbers_only(mixed_set: SetInfo) -> None:
    """Issue 39: one index rule (the reader's) for the parts and the indices split by store."""
    with open_reader(mixed_set.paths) as reader, pytest.raises(ValueError, match="boolean mask"):
        store_parts(reader, np.ones(len(reader), bool))
    with pytest.raises(ValueError, match="integer sample indices"):
        MixedBatchSampler([[0.5, 1.5], [2, 3]], [1, 1], 2)
