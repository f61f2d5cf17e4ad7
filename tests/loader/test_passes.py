"""Epochs of passes and resumable state of every sampler (lmdbstore.loader.passes): a new order on every pass
without set_epoch, set_epoch pinning one, iter() without a batch beginning nothing, and state_dict /
load_state_dict resuming exactly inside an epoch (and after a finished one), refusing foreign state."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

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
