"""The loader's own state (the feed's delivered count, lmdbstore/feed/feed.py): ``make_loader(...).state_dict()``
counts the batches delivered to the loop, not those its readers drew ahead, and a resumed loader delivers exactly the batches
not yet delivered -- every sample of the epoch once across the interruption -- with 0, 2 and 8 workers,
stopped at the start, inside and at the end of an epoch, with and without ``set_epoch``.  Real stores, real
reader processes."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from conftest import StoreInfo

from lmdbstore.config import LoaderConfig
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler

N, BATCH = 2000, 125  # 16 batches an epoch
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 8 worker processes")


def _ids(x: Any) -> list[int]:
    """The sample indices of a batch (the first value of a test sample encodes its index)."""
    return x[:, 0, 0, 0].round().long().tolist()  # type: ignore[no-any-return]


def _loader(store: StoreInfo, workers: int, sampler: Any = None, **cfg: Any) -> Any:
    sampler = sampler if sampler is not None else EpochBatchSampler(np.arange(N), BATCH, seed=7)
    config = LoaderConfig(batch_size=BATCH, workers=workers, multiprocessing_context="fork" if workers else None, **cfg)
    return make_loader(LmdbBatchDataset(store.path), sampler, config)


def _reference(epochs: int) -> list[list[list[int]]]:
    sampler = EpochBatchSampler(np.arange(N), BATCH, seed=7)
    return [[b.tolist() for b in sampler.batches(e)] for e in range(epochs)]


def test_the_state_counts_batches_delivered_while_the_sampler_has_drawn_ahead(small_store: StoreInfo) -> None:
    loader = _loader(small_store, 2)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    assert loader.state_dict()["position"] == 5
    assert loader.sampler.state_dict()["position"] > 5  # the readers' batches: drawn, not trained
    batches.close()


@pytest.mark.parametrize(
    ("workers", "stop", "set_epoch"),
    [
        (0, 0, False),
        (0, 7, True),
        (2, 5, False),
        (2, 5, True),
        (2, 15, True),
        (2, 16, False),
        (8, 3, False),
        (8, 9, True),
    ],
)
def test_a_resumed_loader_delivers_exactly_the_batches_not_yet_delivered(
    small_store: StoreInfo, workers: int, stop: int, set_epoch: bool
) -> None:
    reference = _reference(3)
    loader = _loader(small_store, workers)
    if set_epoch:
        loader.sampler.set_epoch(0)
    assert [_ids(x) for x, _ in loader] == reference[0]
    if set_epoch:
        loader.sampler.set_epoch(1)
    batches = iter(loader)
    head = [_ids(next(batches)[0]) for _ in range(stop)]  # the loop took ``stop`` batches of epoch 1
    assert head == reference[1][:stop]
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint keeps it
    at = (state["epoch"], state["position"])
    assert at == (1, stop) or (stop, at) == (0, (0, 16))  # before epoch 1 began: the end of epoch 0
    del batches, loader  # killed
    resumed = _loader(small_store, workers)
    resumed.load_state_dict(state)
    if set_epoch:
        resumed.sampler.set_epoch(1)  # what the loop does before the epoch: keeps the restored position
    rest = [_ids(x) for x, _ in resumed]
    if stop == len(reference[1]):  # saved at the end of the epoch: the next one follows, not an empty pass
        assert rest == reference[2]
        return
    assert head + rest == reference[1]  # every batch of the epoch once, in its order
    assert sorted(i for b in head + rest for i in b) == list(range(N))  # so every sample once
    if set_epoch:
        resumed.sampler.set_epoch(2)
    assert [_ids(x) for x, _ in resumed] == reference[2]
    assert resumed.state_dict()["position"] == len(reference[2])


def test_a_state_saved_before_any_batch_or_reloaded_before_iterating_is_the_same(small_store: StoreInfo) -> None:
    loader = _loader(small_store, 0)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (0, 0)
    state = {**loader.state_dict(), "epoch": 2, "position": 4}
    loader.load_state_dict(state)
    assert loader.state_dict() == state  # nothing delivered since the load
    assert [_ids(x) for x, _ in loader] == _reference(3)[2][4:]


def test_loading_a_state_while_a_pass_runs_applies_to_the_next_pass(small_store: StoreInfo) -> None:
    reference = _reference(2)
    loader = _loader(small_store, 2)
    batches = iter(loader)
    first = [_ids(next(batches)[0]) for _ in range(3)]
    loader.load_state_dict({**loader.state_dict(), "epoch": 1, "position": 10})
    assert _ids(next(batches)[0]) == reference[0][3]  # the running pass goes on as it was
    assert loader.state_dict()["position"] == 10  # the delivered batches of a pass no longer resumed
    batches.close()
    assert first == reference[0][:3]
    assert [_ids(x) for x, _ in loader] == reference[1][10:]


def test_a_state_of_another_sampler_is_refused_naming_what_differs(small_store: StoreInfo) -> None:
    state = _loader(small_store, 0).state_dict()
    other = _loader(small_store, 0, EpochBatchSampler(np.arange(N), 100, seed=7))
    with pytest.raises(ValueError, match="batch_size 125, this sampler has 100"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="position 17 is past the 16 batches"):
        _loader(small_store, 0).load_state_dict({**state, "position": 17})


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_without_state_resumes_by_count(small_store: StoreInfo, workers: int) -> None:
    batches = [np.arange(i, min(i + BATCH, N)) for i in range(0, N, BATCH)][::-1]  # a fixed order of its own
    loader = _loader(small_store, workers, batches)
    head = []
    for x, _ in loader:
        head.append(_ids(x))
        if len(head) == 6:
            break
    state = loader.state_dict()
    assert state == {"position": 6, "batches": 16}
    resumed = _loader(small_store, workers, batches)
    resumed.load_state_dict(state)
    assert head + [_ids(x) for x, _ in resumed] == [b.tolist() for b in batches]
    assert resumed.state_dict() == {"position": 16, "batches": 16}
    assert len([_ids(x) for x, _ in resumed]) == 16  # a finished pass: the next one is whole
    with pytest.raises(ValueError, match="for a sampler of 15 batches, this one has 16"):
        resumed.load_state_dict({"position": 1, "batches": 15})
