"""The pieces the epoch orders are built from (lmdbstore.loader.orders): runs kept whole, batches dealt to
ranks, one seeded stream per epoch and purpose."""

from __future__ import annotations

import numpy as np
import pytest

from lmdbstore.loader.orders import concat_runs, deal_batches, epoch_rng


def test_concat_runs() -> None:
    src = np.arange(100, 107)
    got = concat_runs(src, np.array([5, 0, 2]), np.array([2, 1, 3]))
    assert got.tolist() == [105, 106, 100, 102, 103, 104]
    assert concat_runs(src, np.zeros(0, np.int64), np.zeros(0, np.int64)).size == 0


@pytest.mark.parametrize(("n", "batch", "world"), [(1003, 64, 1), (1003, 64, 2), (1003, 64, 3), (5, 64, 4), (0, 8, 2)])
def test_deal_batches_covers_the_order_once_in_equal_steps(n: int, batch: int, world: int) -> None:
    order = np.random.default_rng(n).permutation(n)
    batches = deal_batches(order, batch, world)
    assert np.array_equal(np.concatenate(batches) if batches else np.zeros(0, np.int64), order)
    assert all(len(b) <= batch for b in batches)
    assert len(batches) % world == 0  # every rank gets the same number of steps
    if world == 1:
        assert all(len(b) == batch for b in batches[:-1])
    elif batches:
        sizes = [len(b) for b in batches]
        assert max(sizes) - min(sizes) <= 1


def test_epoch_rng_depends_on_seed_epoch_and_stream_only() -> None:
    draw = [epoch_rng(s, e, k).integers(0, 1 << 30, 4).tolist() for s, e, k in [(1, 0, 0), (1, 0, 0), (1, 1, 0)]]
    assert draw[0] == draw[1] != draw[2]
    assert epoch_rng(1, 0, 7).integers(0, 1 << 30) != epoch_rng(1, 0, 0).integers(0, 1 << 30)
    assert epoch_rng(2, 0).integers(0, 1 << 30) != epoch_rng(1, 0).integers(0, 1 << 30)
