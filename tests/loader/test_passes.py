"""Epochs of passes and resumable state of every sampler (lmdbstore.loader.passes): a new order on every pass
without set_epoch, set_epoch pinning one, iter() without a batch beginning nothing, and state_dict /
load_state_dict resuming exactly inside an epoch (and after a finished one), refusing foreign state.  Then the
same through real DataLoader workers: every pass over make_loader's loader is the next epoch's order without
set_epoch (and the first is epoch 0, though the DataLoader calls iter() twice), set_epoch pins, and torchdata's
StatefulDataLoader resumes a killed epoch exactly through the sampler's state, with and without set_epoch, with and
without workers."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from conftest import StoreInfo

from lmdbstore.config import LoaderConfig
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.mixing import MixedBatchSampler
from lmdbstore.loader.passes import process_group
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler
from lmdbstore.loader.window import WindowBatchSampler

N = 3000


def _epoch(**kw: object) -> Callable[[], EpochBatchSampler]:
    return lambda: EpochBatchSampler(np.arange(N), 128, samples_per_value=18, seed=3, **kw)  # type: ignore[arg-type]


def _window() -> WindowBatchSampler:
    return WindowBatchSampler(
        np.arange(N), 128, samples_per_value=18, sample_bytes=2500, window_bytes=600 * 2500, chunk_bytes=90 * 2500
    )


def _balanced() -> BalancedBatchSampler:
    return BalancedBatchSampler([np.arange(0, 2000), np.arange(2000, 2100), np.arange(2100, N)], 128, seed=3)


FACTORIES = {
    "random": _epoch(shuffle="random"),
    "block": _epoch(shuffle="block"),
    "window": _window,
    "balanced": _balanced,
}


def _pass(it: object) -> list[list[int]]:
    return [b.tolist() for b in it]  # type: ignore[attr-defined]


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest) -> Callable[[], object]:
    return FACTORIES[request.param]


def test_every_pass_is_the_next_epoch_without_set_epoch(make: Callable[[], object]) -> None:
    s = make()
    passes = [_pass(s) for _ in range(3)]  # a plain loop, as Keras runs it: no set_epoch
    assert s.epoch == 2  # type: ignore[attr-defined]
    for e, got in enumerate(passes):
        assert got == _pass(s.batches_from(e, 0))  # type: ignore[attr-defined]
    assert passes[0] != passes[1] != passes[2]
    fresh = make()
    assert _pass(fresh) == passes[0]  # the first pass of a new sampler is epoch 0


def test_set_epoch_pins_the_order_of_every_pass_it_precedes(make: Callable[[], object]) -> None:
    s = make()
    s.set_epoch(5)  # type: ignore[attr-defined]
    a = _pass(s)
    s.set_epoch(5)  # type: ignore[attr-defined]
    assert _pass(s) == a
    assert _pass(s) == _pass(s.batches_from(6, 0))  # type: ignore[attr-defined]  # unpinned: the next one


def test_an_iterator_that_never_yields_begins_no_pass(make: Callable[[], object]) -> None:
    s = make()
    for _ in range(3):
        iter(s)  # a DataLoader calls iter() on its sampler twice and uses only the second iterator
    assert _pass(s) == _pass(s.batches_from(0, 0))  # type: ignore[attr-defined]


def test_abandoned_pass_still_counts(make: Callable[[], object]) -> None:
    s = make()
    next(iter(s))  # type: ignore[call-overload]
    assert _pass(s) == _pass(s.batches_from(1, 0))  # type: ignore[attr-defined]


@pytest.mark.parametrize("stop", [1, 7, 23])
def test_state_dict_resumes_inside_the_epoch_in_a_new_sampler(make: Callable[[], object], stop: int) -> None:
    s = make()
    _pass(s)  # epoch 0
    it = iter(s)  # type: ignore[call-overload]
    head = [next(it).tolist() for _ in range(stop)]
    state = s.state_dict()  # type: ignore[attr-defined]
    assert (state["epoch"], state["position"]) == (1, stop)
    assert state == it.state_dict()
    rest = _pass(it)
    resumed = make()
    resumed.load_state_dict(state)  # type: ignore[attr-defined]
    resumed.set_epoch(1)  # type: ignore[attr-defined]  # a loop that pins the same epoch keeps the position
    assert _pass(resumed) == rest
    assert head + rest == _pass(s.batches_from(1, 0))  # type: ignore[attr-defined]
    assert _pass(resumed) == _pass(s.batches_from(2, 0))  # type: ignore[attr-defined]  # then on as before


def test_state_of_a_finished_pass_resumes_with_the_next_epoch(make: Callable[[], object]) -> None:
    s = make()
    _pass(s)
    state = s.state_dict()  # type: ignore[attr-defined]
    assert state["position"] == len(s)  # type: ignore[arg-type]
    resumed = make()
    resumed.load_state_dict(state)  # type: ignore[attr-defined]
    assert _pass(resumed) == _pass(s)
    # loaded into an iterator (what torchdata does), the restored pass is an empty one of that epoch
    again = make()
    it = iter(again)  # type: ignore[call-overload]
    it.load_state_dict(state)
    assert _pass(it) == []
    assert _pass(again) == _pass(s.batches_from(1, 0))  # type: ignore[attr-defined]


def test_set_epoch_to_another_epoch_drops_a_restored_position() -> None:
    s = FACTORIES["random"]()
    s.load_state_dict({**s.state_dict(), "epoch": 4, "position": 3})
    s.set_epoch(2)
    assert _pass(s) == _pass(s.batches_from(2, 0))


def test_foreign_or_malformed_state_is_refused_naming_what_differs() -> None:
    s = FACTORIES["random"]()
    good = s.state_dict()
    for key, value in [("seed", 4), ("batch_size", 64), ("samples", 10), ("world_size", 2), ("kind", "block")]:
        with pytest.raises(ValueError, match=key):
            s.load_state_dict({**good, key: value})
    for bad in [{"epoch": -1}, {"position": "3"}, {"position": 10**6}, {"epoch": True}]:
        with pytest.raises(ValueError, match=r"epoch|position"):
            s.load_state_dict({**good, **bad})
    with pytest.raises(ValueError, match="dict"):
        s.load_state_dict([1, 2])  # type: ignore[arg-type]


def test_a_state_of_another_window_size_block_buffer_or_mix_is_refused() -> None:
    """The order depends on them too: a window of another size (its default follows free memory), another block
    buffer or other store weights draw other batches, so a position in one is refused, never applied to another."""
    window = _window().state_dict()
    other = WindowBatchSampler(
        np.arange(N), 128, samples_per_value=18, sample_bytes=2500, window_bytes=700 * 2500, chunk_bytes=90 * 2500
    )
    with pytest.raises(ValueError, match="window_samples 600, this sampler has 700"):
        other.load_state_dict(window)
    block = _epoch(shuffle="block", block_buffer=2)().state_dict()
    with pytest.raises(ValueError, match="block_buffer 2, this sampler has 4"):
        _epoch(shuffle="block", block_buffer=4)().load_state_dict(block)
    parts = [np.arange(0, 1000), np.arange(1000, N)]
    mixed = MixedBatchSampler(parts, [0.5, 0.5], 128, seed=3).state_dict()
    with pytest.raises(ValueError, match="counts"):
        MixedBatchSampler(parts, [0.7, 0.3], 128, seed=3).load_state_dict(mixed)
    MixedBatchSampler(parts, [1.0, 1.0], 128, seed=3).load_state_dict(mixed)  # the same shares: the same order


def test_without_a_process_group_a_sampler_is_the_only_rank() -> None:
    assert process_group() == (0, 1)
    s = EpochBatchSampler(np.arange(10), 4)
    assert (s.rank, s.world_size) == (0, 1)
    with pytest.raises(ValueError, match="rank"):
        EpochBatchSampler(np.arange(10), 4, rank=2, world_size=2)


# ---------------------------------------------------------------------- through real DataLoader workers
BATCH = 64
#: torchdata's own call warns; nothing of ours.
TORCHDATA_WARNING = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


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


@TORCHDATA_WARNING
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


@TORCHDATA_WARNING
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
