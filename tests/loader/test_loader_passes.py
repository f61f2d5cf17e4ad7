"""Passes through real DataLoader workers: every pass over make_loader's loader is the next epoch's order
without set_epoch (and the first is epoch 0, though the DataLoader calls iter() twice), set_epoch pins, and
torchdata's StatefulDataLoader resumes a killed epoch exactly through the sampler's state, with and without
set_epoch, with and without workers."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import StoreInfo

from lmdbstore.config import LoaderConfig
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler

BATCH = 64
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own call


def _seen(batches: object) -> list[list[int]]:
    """The sample indices of each ``(x, y)`` batch (the first value of a test sample encodes its index)."""
    return [x[:, 0, 0, 0].round().long().tolist() for x, _ in batches]  # type: ignore[attr-defined]


def _sampler(n: int) -> EpochBatchSampler:
    return EpochBatchSampler(np.arange(n), BATCH, shuffle="random", seed=11)


@pytest.mark.parametrize("persistent", [True, False])
def test_each_pass_over_the_loader_is_the_next_epoch(small_store: StoreInfo, persistent: bool) -> None:
    sampler = _sampler(2000)
    cfg = LoaderConfig(batch_size=BATCH, workers=2, persistent_workers=persistent, multiprocessing_context="fork")
    loader = make_loader(LmdbBatchDataset(small_store.path), sampler, cfg)
    passes = [_seen(loader) for _ in range(3)]
    for epoch, got in enumerate(passes):
        assert got == [b.tolist() for b in sampler.batches(epoch)]
        assert sorted(i for b in got for i in b) == list(range(2000))
    assert passes[0] != passes[1] != passes[2]
    loader.sampler.set_epoch(1)  # pinned through the loader's sampler
    assert _seen(loader) == passes[1]


def _stateful(store: StoreInfo, sampler: EpochBatchSampler, workers: int):  # type: ignore[no-untyped-def]
    from torchdata.stateful_dataloader import StatefulDataLoader

    kw = {"multiprocessing_context": "fork", "persistent_workers": True} if workers else {}
    return StatefulDataLoader(LmdbBatchDataset(store.path), sampler=sampler, batch_size=None, num_workers=workers, **kw)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("use_set_epoch", [False, True])
@pytest.mark.parametrize("stop", [0, 5, 31])
def test_torchdata_resumes_a_killed_epoch_exactly(
    small_store: StoreInfo, workers: int, use_set_epoch: bool, stop: int
) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    reference = [[b.tolist() for b in _sampler(2000).batches(e)] for e in range(3)]  # 32 batches an epoch

    def epoch(loader, sampler, e):  # type: ignore[no-untyped-def]
        if use_set_epoch:
            sampler.set_epoch(e)
        return loader

    sampler = _sampler(2000)
    loader = _stateful(small_store, sampler, workers)
    assert _seen(epoch(loader, sampler, 0)) == reference[0]
    head: list[list[int]] = []
    state = loader.state_dict()  # stop 0: saved before the epoch's first batch
    if stop:
        for x, _ in epoch(loader, sampler, 1):
            head.append(x[:, 0, 0, 0].round().long().tolist())
            if len(head) == stop:
                state = loader.state_dict()
                break
    del loader  # "killed"
    sampler2 = _sampler(2000)
    resumed = _stateful(small_store, sampler2, workers)
    resumed.load_state_dict(state)
    rest = _seen(epoch(resumed, sampler2, 1))
    assert head + rest == reference[1]  # every batch of the epoch once, in its order
    assert _seen(epoch(resumed, sampler2, 2)) == reference[2]


@pytest.mark.parametrize("workers", [0, 2])
def test_torchdata_resumes_after_a_finished_epoch_with_the_next(small_store: StoreInfo, workers: int) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    reference = [[b.tolist() for b in _sampler(2000).batches(e)] for e in range(2)]
    sampler = _sampler(2000)
    loader = _stateful(small_store, sampler, workers)
    assert _seen(loader) == reference[0]
    state = loader.state_dict()
    resumed = _stateful(small_store, _sampler(2000), workers)
    resumed.load_state_dict(state)
    assert _seen(resumed) == reference[1]  # no empty pass for the finished epoch first
