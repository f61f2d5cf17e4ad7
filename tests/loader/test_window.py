"""The windowed shuffle (lmdbstore.loader.window): coverage, determinism, DDP shares, prefetch, quality, choice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import build_store, make_data

from lmdbstore import WriterConfig
from lmdbstore.loader.plans import WindowSequence
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.loader.window import WindowBatchSampler, choose_shuffle, default_window_bytes
from lmdbstore.store.reader import StoreReader

SB = 2500  # bytes of a 25x25 float32 sample


def sampler(indices: np.ndarray, **kw: object) -> WindowBatchSampler:
    args: dict[str, object] = {"samples_per_value": 18, "sample_bytes": SB, "window_bytes": 2000 * SB}
    args.update(kw)
    args.setdefault("chunk_bytes", 90 * SB)  # 5 values per chunk
    return WindowBatchSampler(indices, 128, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 17, 1000, 10_001])
def test_every_sample_once_per_epoch(n: int) -> None:
    idx = np.arange(n)
    s = sampler(idx)
    for epoch in range(3):
        s.set_epoch(epoch)
        got = np.concatenate(list(s))
        assert sorted(got.tolist()) == idx.tolist()
        assert all(len(b) <= 128 for b in s)
        assert len(list(s)) == len(s)


def test_sparse_indices_of_a_split() -> None:
    idx = np.sort(np.random.default_rng(0).choice(50_000, 7_000, replace=False))
    got = np.concatenate(list(sampler(idx)))
    assert np.array_equal(np.sort(got), idx)


def test_deterministic_under_seed_and_epoch() -> None:
    idx = np.arange(5000)
    a, b = sampler(idx, seed=4), sampler(idx, seed=4)
    a.set_epoch(2)
    b.set_epoch(2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    b.set_epoch(3)
    assert not np.array_equal(a.epoch_order(), b.epoch_order())
    c = sampler(idx, seed=5)
    c.set_epoch(2)
    assert not np.array_equal(a.epoch_order(), c.epoch_order())


def test_windows_hold_whole_chunks_and_mix_within() -> None:
    idx = np.arange(20_000)
    plan = WindowSequence(idx, 18, window_samples=2000, chunk_samples=90, rng=np.random.default_rng(1))
    order = plan.order()
    assert plan.window_starts[0] == 0 and plan.window_starts[-1] == len(idx)
    for w in range(len(plan.chunk_lo)):
        part = order[plan.window_starts[w] : plan.window_starts[w + 1]]
        inside = np.zeros(len(idx), bool)
        for lo, hi in zip(plan.chunk_lo[w], plan.chunk_hi[w], strict=True):
            inside[lo:hi] = True
        assert inside[part].all() and inside.sum() == len(part)  # a window is exactly its chunks' samples
        assert len(plan.chunk_lo[w]) <= 2000 // 90 + 1
    first = order[: plan.window_starts[1]]
    assert not np.array_equal(first, np.sort(first))  # shuffled within the window


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_ranks_share_one_global_order(world: int) -> None:
    idx = np.arange(9_999)
    ranks = [sampler(idx, rank=r, world_size=world) for r in range(world)]
    parts = [list(s) for s in ranks]
    assert len({len(p) for p in parts}) == 1  # the same number of steps on every rank
    got = np.concatenate([np.concatenate(p) for p in parts])
    assert sorted(got.tolist()) == idx.tolist()
    order = ranks[0].epoch_order()  # every rank holds the same global order, dealt round-robin
    dealt = np.concatenate([parts[j % world][j // world] for j in range(sum(len(p) for p in parts))])
    assert np.array_equal(dealt, order)


def test_drop_last() -> None:
    s = sampler(np.arange(1000), world_size=2, drop_last=True)
    assert all(len(b) == 128 for b in s)
    assert len(list(s)) == len(s) == 1000 // 256


def test_prefetch_is_called_one_window_ahead() -> None:
    calls: list[tuple[np.ndarray, np.ndarray]] = []
    s = sampler(np.arange(10_000), prefetch=lambda lo, hi: calls.append((lo, hi)))
    plan = s.plan()
    n_windows = len(plan.chunk_lo)
    assert n_windows >= 4
    it = iter(s)
    next(it)
    assert len(calls) == 2  # the first window and the next
    for (lo, hi), w in zip(calls, range(2), strict=True):
        assert np.array_equal(lo, plan.chunk_lo[w]) and np.array_equal(hi, plan.chunk_hi[w])
    list(it)
    assert len(calls) == n_windows + 1  # each window prefetched once, then the next epoch's first (issue 27)
    nxt = sampler(np.arange(10_000)).plan(1)
    assert np.array_equal(calls[-1][0], nxt.chunk_lo[0]) and np.array_equal(calls[-1][1], nxt.chunk_hi[0])
    again = list(s)  # epoch 1: its first window is not asked for again; the one after it is, and so on
    assert np.array_equal(np.concatenate(again), nxt.order())
    assert len(calls) == (n_windows + 1) + n_windows and np.array_equal(calls[n_windows + 1][0], nxt.chunk_lo[1])


def test_prefetch_reads_the_range_into_the_page_cache(tmp_path: Path) -> None:
    x, y = make_data(3000, seed=2)
    path = build_store(tmp_path / "s", x, y, config=WriterConfig(sync=False))
    with StoreReader(path) as r:
        r.prefetch(np.array([0, 1800]), np.array([900, 3000]))  # no error; a no-op for correctness
        s = WindowBatchSampler(np.arange(3000), 256, samples_per_value=18, sample_bytes=SB, prefetch=r.prefetch)
        got = [r.read_batch(b) for b in s]
        order = np.concatenate(s.batches(0))  # the first pass's (a second pass is the next epoch)
        np.testing.assert_array_equal(np.concatenate(got), x[order])
    with StoreReader(path, positions=False) as r:
        r.prefetch(np.array([0]), np.array([10]))  # nothing to do on the liblmdb path


def test_class_mix_on_a_class_sorted_store() -> None:
    """On a store written one class after another, window batches carry every class in about the store's
    shares, and draw from many more values per batch than block order."""
    n, k = 50_000, 5
    labels = np.repeat(np.arange(k), n // k)
    idx = np.arange(n)

    def tvd(batches: list[np.ndarray]) -> float:
        return float(
            np.mean([0.5 * np.abs(np.bincount(labels[b], minlength=k) / len(b) - 1 / k).sum() for b in batches])
        )

    window = list(WindowBatchSampler(idx, 512, samples_per_value=18, sample_bytes=SB, window_bytes=20_000 * SB))
    block = list(EpochBatchSampler(idx, 512, shuffle="block", samples_per_value=18))
    assert tvd(window) < 0.1 < 0.5 < tvd([idx[i : i + 512] for i in range(0, n, 512)])  # vs. no shuffle

    def distinct(batches: list[np.ndarray]) -> float:
        return float(np.mean([len(np.unique(b // 18)) for b in batches]))

    assert distinct(window) > 4 * distinct(block)


def test_choose_shuffle() -> None:
    gib = 1 << 30
    assert choose_shuffle(10 * gib, available=20 * gib).shuffle == "random"
    far = choose_shuffle(30 * gib, available=20 * gib)
    assert far.shuffle == "window" and "30.0 GiB" in far.reason
    assert default_window_bytes(16 * gib) == 2 * gib
    assert default_window_bytes(0) == 64 << 20
    assert choose_shuffle(1).shuffle == "random"  # the real machine's memory


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="sample_bytes"):
        WindowBatchSampler(np.arange(10), 4, samples_per_value=1, sample_bytes=0)
    with pytest.raises(ValueError, match="window_bytes"):
        WindowBatchSampler(np.arange(10), 4, samples_per_value=1, sample_bytes=4, window_bytes=0)
    with pytest.raises(ValueError, match="batch_size"):
        WindowBatchSampler(np.arange(10), 0, samples_per_value=1, sample_bytes=4)


def test_first_window_is_capped_so_training_starts_at_once() -> None:
    gib = 1 << 30
    s = WindowBatchSampler(np.arange(2_000_000), 4096, samples_per_value=18, sample_bytes=SB, window_bytes=gib)
    plan = s.plan()
    sizes = np.diff(plan.window_starts)
    assert sizes[0] <= (256 << 20) // SB < sizes[1]  # 256 MiB first, then full windows
    assert sizes[1] <= gib // SB
    assert all(len(lo) >= 240 for lo in plan.chunk_lo[:-1])  # ~256 chunks (whole values): a store-like class mix


def test_a_window_is_bounded_by_the_machine_not_by_the_argument() -> None:
    """``window_mb`` beyond the data only holds all of it (kept: the order depends on it); beyond what the machine
    can give (half its available memory: the window and the next one read ahead) it is clipped with a warning
    naming the parameter (issue 34, memory)."""
    import warnings

    from lmdbstore.loader.window import bound_window_bytes
    from lmdbstore.util.memory import MemoryBoundWarning

    gib = 1 << 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bound_window_bytes(10**15, 5 * gib, available=16 * gib) == 10**15  # holds all 5 GiB: fits in 8
        assert bound_window_bytes(2 * gib, 100 * gib, available=16 * gib) == 2 * gib
    with pytest.warns(MemoryBoundWarning, match=r"window_mb: a window of 20\.0 GiB .* using 8\.0 GiB"):
        assert bound_window_bytes(20 * gib, 100 * gib, "window_mb", available=16 * gib) == 8 * gib
    with pytest.warns(MemoryBoundWarning, match="window_bytes"):
        assert bound_window_bytes(10**15, 100 * gib, available=16 * gib) == 8 * gib
    with pytest.raises(ValueError, match="window_mb must be positive"):
        bound_window_bytes(0, 1, "window_mb")
    # a window far larger than a small store: no warning on this machine, the order of the default window
    idx = np.arange(5000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        huge = WindowBatchSampler(idx, 512, samples_per_value=18, sample_bytes=SB, window_bytes=10**15)
    assert (
        huge.batches(0)[0].tolist()
        == WindowBatchSampler(idx, 512, samples_per_value=18, sample_bytes=SB).batches(0)[0].tolist()
    )


def test_ranks_sharing_an_order_get_one_window_size_whatever_memory_each_has_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An eighth of free memory differs between processes; windows of different sizes are different orders, and
    ranks taking shares of different orders read some samples twice and others never.  So ranks sharing one
    order (world_size > 1) default to one fixed size; a single process keeps its share of free memory."""
    from lmdbstore.loader import window as window_module

    def sampler(rank: int, world: int) -> WindowBatchSampler:
        return WindowBatchSampler(np.arange(2_000_000), 64, samples_per_value=18, sample_bytes=2500, rank=rank,
                                  world_size=world)  # fmt: skip

    ranks = []
    for rank, free in ((0, 22 << 30), (1, 9 << 30)):  # two nodes, other free memory
        monkeypatch.setattr(window_module, "available_memory", lambda free=free: free)
        ranks.append(sampler(rank, 2))
    assert ranks[0].window_samples == ranks[1].window_samples == window_module.SHARED_WINDOW_BYTES // 2500
    shares = [np.concatenate(list(s.batches_from(0, 0))) for s in ranks]
    assert len(np.intersect1d(shares[0], shares[1])) == 0  # the shares of one order: disjoint
    assert len(shares[0]) + len(shares[1]) == 2_000_000
    assert sampler(0, 1).window_samples == (1 << 30) // 2500  # alone: an eighth of 9 GiB, rounded down
