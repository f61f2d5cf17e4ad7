"""The generators a batch's user code sees (lmdbstore.feed.seeding): seeded per batch from the run's seed, its
epoch and its number, in real reader processes.  Forked readers used to share the consumer's generator state, so
a transform drawing from ``np.random`` drew the same numbers in every reader (issue 33: 20 of 40 draws repeated);
now every batch draws its own, the same on a rerun and after a resume, and the consumer's own generators are
never touched."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import StoreInfo

from lmdbstore import EpochBatchSampler, LmdbBatchDataset, make_loader
from lmdbstore.config import LoaderConfig
from lmdbstore.feed.seeding import batch_seeds, seeded

BATCH = 100
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def draws(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Writes one draw of each generator into the batch's first sample: numpy, random and torch."""
    x[0, 0, 0, 0] = np.random.random()
    x[0, 0, 0, 1] = random.random()
    x[0, 0, 0, 2] = torch.rand(()).item()
    return x, y


def _draws(store: StoreInfo, workers: int, seed: int, epochs: int = 2, start: dict | None = None) -> list[tuple]:
    ds = LmdbBatchDataset(store.path, transform=draws)
    sampler = EpochBatchSampler(np.arange(len(ds)), BATCH, seed=1)
    loader = make_loader(ds, sampler, LoaderConfig(batch_size=BATCH, workers=workers, seed=seed))
    if start is not None:
        loader.load_state_dict(start)
    out = []
    for _ in range(epochs):
        out.extend(tuple(x[0, 0, 0, :3].tolist()) for x, _ in loader)
    loader.close()
    return out


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_every_batch_draws_its_own_numbers_the_same_on_a_rerun(small_store: StoreInfo, workers: int) -> None:
    first = _draws(small_store, workers, seed=5)
    assert len(first) == 40 and len(set(first)) == 40  # 20 batches x 2 epochs: no draw repeats
    assert len({d[0] for d in first}) == len({d[1] for d in first}) == len({d[2] for d in first}) == 40
    assert _draws(small_store, workers, seed=5) == first  # a rerun with the same seed: the same draws
    assert set(_draws(small_store, workers, seed=6)).isdisjoint(first)  # another seed: others


def test_the_draws_do_not_depend_on_readers_or_on_a_resume(small_store: StoreInfo) -> None:
    unbroken = _draws(small_store, 2, seed=5)
    assert _draws(small_store, 3, seed=5) == unbroken  # per batch, not per reader
    state = {"epoch": 0, "position": 7, "kind": "random", "seed": 1, "batch_size": BATCH, "samples": 2000,
             "world_size": 1}  # fmt: skip
    resumed = _draws(small_store, 2, seed=5, epochs=1, start=state)
    assert resumed == unbroken[7:20]  # batch k of epoch 0 draws the same after the resume


def test_the_consumers_own_generators_are_left_as_they_were(small_store: StoreInfo) -> None:
    np.random.seed(123)
    random.seed(123)
    torch.manual_seed(123)
    want = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state())
    _draws(small_store, 0, seed=5, epochs=1)  # no readers: the transform runs in this process
    assert np.array_equal(np.random.get_state()[1], want[0])
    assert random.getstate() == want[1]
    assert torch.equal(torch.get_rng_state(), want[2])


def test_batch_seeds_are_independent_streams() -> None:
    a, b = batch_seeds((0, 0, 0)), batch_seeds((0, 0, 1))
    assert a[0] != b[0] and a[2] != b[2] and not np.array_equal(a[1], b[1])
    assert batch_seeds((0, 1, 0))[0] != a[0] and batch_seeds((1, 0, 0))[0] != a[0]
    big = batch_seeds((2**70, 3, 4)), batch_seeds((2**70, 3, 4))  # any int seed
    assert big[0][0] == big[1][0] and np.array_equal(big[0][1], big[1][1])
    state = np.random.get_state()[1].copy()
    with seeded(None, restore=True):
        pass
    assert np.array_equal(np.random.get_state()[1], state)  # no seed: nothing touched
