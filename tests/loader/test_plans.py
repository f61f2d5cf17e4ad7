"""Epoch orders made on demand (lmdbstore.loader.plans, issue 27): the block and window orders, their batches and
their slices are exactly the eager orders' (the reference implementations below are the code they replace),
draw for draw, for arbitrary index sets, packings, batch sizes, ranks and resume points."""

from __future__ import annotations

import numpy as np
import pytest

from lmdbstore.loader.orders import concat_runs, deal_batches
from lmdbstore.loader.plans import BlockPlan, WindowSequence, batch_bounds, value_starts
from lmdbstore.loader.samplers import EpochBatchSampler, block_order
from lmdbstore.loader.window import WindowBatchSampler


def runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of every run of equal consecutive ``keys``."""
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return starts, np.diff(np.r_[starts, keys.size])


def shuffle_runs(
    src: np.ndarray, keys: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of equal ``keys`` of ``src`` in a random order (one ``rng.permutation``), each kept whole."""
    starts, lengths = runs(keys)
    perm = rng.permutation(len(starts))
    starts, lengths = starts[perm], lengths[perm]
    return concat_runs(src, starts, lengths), starts, lengths


def reference_block_order(
    indices: np.ndarray, spv: int, batch_size: int, block_buffer: int, rng: np.random.Generator
) -> np.ndarray:
    """The eager block order as it was before issue 27."""
    idx = np.sort(np.asarray(indices, dtype=np.int64))
    if idx.size == 0:
        return idx
    order, _, g_len = shuffle_runs(idx, idx // spv, rng)
    if block_buffer <= 1:
        return order
    g_start = np.cumsum(g_len) - g_len
    piece = np.repeat(np.arange(len(g_len)) * block_buffer, g_len) + (
        (np.arange(idx.size) - np.repeat(g_start, g_len)) * block_buffer // np.repeat(g_len, g_len)
    )
    p_start, p_len = runs(piece)
    window = np.asarray(p_start // max(1, block_buffer * batch_size))
    shuffled = np.lexsort((rng.random(len(p_start)), window))
    return concat_runs(order, p_start[shuffled], p_len[shuffled])


def reference_window_order(
    indices: np.ndarray, spv: int, window_samples: int, chunk_samples: int, rng: np.random.Generator, first: int | None
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """The eager windowed order as it was before issue 27: (order, window starts, chunk_lo, chunk_hi)."""
    idx = np.sort(np.asarray(indices, dtype=np.int64))
    if idx.size == 0:
        return idx, np.zeros(1, np.int64), [], []
    vals = idx // spv
    val_rank = np.cumsum(np.r_[True, vals[1:] != vals[:-1]]) - 1
    per_chunk = max(1, -(-chunk_samples // spv))
    order, starts, lengths = shuffle_runs(idx, val_rank // per_chunk, rng)
    per_window = max(1, window_samples // max(1, per_chunk * spv))
    first_w = per_window if first is None else min(per_window, max(1, first // max(1, per_chunk * spv)))
    cum = np.r_[0, np.cumsum(lengths)]
    bounds = np.unique(np.r_[0, np.arange(first_w, len(starts), per_window), len(starts)])
    win_starts = cum[bounds]
    lo_all, hi_all = idx[starts], idx[starts + lengths - 1] + 1
    chunk_lo, chunk_hi = [], []
    for w in range(len(win_starts) - 1):
        a, b = int(win_starts[w]), int(win_starts[w + 1])
        rng.shuffle(order[a:b])
        chunk_lo.append(np.sort(lo_all[bounds[w] : bounds[w + 1]]))
        chunk_hi.append(np.sort(hi_all[bounds[w] : bounds[w + 1]]))
    return order, win_starts, chunk_lo, chunk_hi


def _indices(rng: np.random.Generator) -> np.ndarray:
    n = int(rng.integers(0, 2500))
    if rng.random() < 0.5:
        return rng.choice(6000, n, replace=False)  # a split: scattered, unsorted
    return np.arange(n) + int(rng.integers(0, 40))


def test_block_orders_and_slices_are_the_eager_ones() -> None:
    rng = np.random.default_rng(11)
    for t in range(150):
        idx = _indices(rng)
        spv, bs, bb = int(rng.integers(1, 30)), int(rng.integers(1, 150)), int(rng.integers(0, 5))
        want = reference_block_order(idx, spv, bs, bb, np.random.default_rng(t))
        np.testing.assert_array_equal(block_order(idx, spv, bs, bb, np.random.default_rng(t)), want)
        plan = BlockPlan(idx, spv, bs, bb, np.random.default_rng(t))
        for _ in range(6):
            lo = int(rng.integers(0, len(idx) + 1))
            hi = int(rng.integers(lo, len(idx) + 1))
            np.testing.assert_array_equal(plan.take(lo, hi), want[lo:hi])


def test_window_orders_are_the_eager_ones() -> None:
    rng = np.random.default_rng(12)
    for t in range(150):
        idx = _indices(rng)
        spv, ws, cs = int(rng.integers(1, 30)), int(rng.integers(1, 700)), int(rng.integers(1, 150))
        first = None if rng.random() < 0.5 else int(rng.integers(1, 400))
        order, starts, lo, hi = reference_window_order(idx, spv, ws, cs, np.random.default_rng(t), first)
        plan = WindowSequence(idx, spv, ws, cs, np.random.default_rng(t), first)
        np.testing.assert_array_equal(plan.order(), order)
        np.testing.assert_array_equal(plan.window_starts, starts)
        assert [a.tolist() for a in plan.chunk_lo] == [a.tolist() for a in lo]
        assert [a.tolist() for a in plan.chunk_hi] == [a.tolist() for a in hi]
        seq = WindowSequence(idx, spv, ws, cs, np.random.default_rng(t), first)
        edges = np.sort(rng.integers(0, len(idx) + 1, 8))
        for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):  # forward, as batches ask
            np.testing.assert_array_equal(seq.take(a, b), order[a:b])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batches_of_every_rank_and_resume_point_are_the_eager_ones(world: int) -> None:
    rng = np.random.default_rng(13 + world)
    for t in range(25):
        idx = _indices(rng)
        spv, bs = int(rng.integers(1, 30)), int(rng.integers(1, 120))
        drop = bool(rng.random() < 0.5)
        step = bs * world
        n = len(idx) // step * step if drop else len(idx)
        bounds = batch_bounds(n, bs, world)
        for rank in range(world):
            kw = {"seed": t, "rank": rank, "world_size": world, "drop_last": drop}
            blk = EpochBatchSampler(idx, bs, shuffle="block", samples_per_value=spv, block_buffer=2, **kw)
            eager = reference_block_order(idx, spv, bs, 2, np.random.default_rng([t, 3, 0]))[:n]
            want = [np.sort(b) for b in deal_batches(eager, bs, world)[rank::world]]
            assert len(deal_batches(eager, bs, world)) == len(bounds) - 1
            got = blk.batches(3)
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
            start = int(rng.integers(0, len(want) + 1))
            rest = list(blk.batches_from(3, start))
            assert len(rest) == len(want) - start
            assert all(np.array_equal(a, b) for a, b in zip(rest, want[start:], strict=True))
            win = WindowBatchSampler(idx, bs, samples_per_value=spv, sample_bytes=10, window_bytes=3000, **kw)
            order = win.plan(3).order()[:n]
            wwant = deal_batches(order, bs, world)[rank::world]
            wgot = list(win.batches_from(3, start))
            assert len(wgot) == len(wwant) - start
            assert all(np.array_equal(a, b) for a, b in zip(wgot, wwant[start:], strict=True))


def test_value_starts_by_search_and_by_comparison_agree() -> None:
    rng = np.random.default_rng(14)
    for _ in range(100):
        idx = np.sort(rng.choice(int(rng.integers(1, 5000)) + 50, int(rng.integers(1, 50)), replace=False))
        dense = np.arange(int(rng.integers(0, 100)), int(rng.integers(100, 3000)))
        for x in (idx, dense):
            spv = int(rng.integers(1, 40))
            vals = x // spv
            want = np.flatnonzero(np.r_[True, vals[1:] != vals[:-1]])
            np.testing.assert_array_equal(value_starts(x, spv), want)


def test_the_first_batch_does_not_wait_for_the_epoch() -> None:
    """A block or window pass over many samples hands out its first batch before the rest of the order exists:
    the block plan holds pieces, not indices, and a window sequence has shuffled one window."""
    n = 2_000_000
    blk = EpochBatchSampler(np.arange(n), 4096, shuffle="block", samples_per_value=18, block_buffer=2, seed=1)
    gen = blk.batches_from(0, 0)
    first = next(gen)
    frame = gen.gi_frame
    assert frame is not None
    plan = frame.f_locals["plan"]
    assert len(first) == 4096 and len(plan._windows) == 1 and plan.src.size < n // 4
    win = WindowBatchSampler(np.arange(n), 4096, samples_per_value=18, sample_bytes=2500, window_bytes=64 << 20, seed=1)
    wgen = win.batches_from(0, 0)
    assert len(next(wgen)) == 4096
    wframe = wgen.gi_frame
    assert wframe is not None
    seq = wframe.f_locals["seq"]
    assert len(seq.chunk_lo) > 3 and list(seq._made) == [0]


def test_a_huge_block_buffer_costs_what_the_data_needs() -> None:
    """``block_buffer`` beyond a value's samples cuts every value into single samples: the plan is cut for that
    many pieces, not for ``block_buffer`` (10**9 allocated a table of 10**9 columns per value), and orders the
    same as any block_buffer whose windows already hold the whole epoch (issue 34, memory)."""
    import tracemalloc

    idx = np.arange(20_000)
    tracemalloc.start()
    huge = BlockPlan(idx, 18, 512, 10**18, np.random.default_rng(3)).take(0, len(idx))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20  # a few arrays of 20,000 entries, not 10**18 columns
    assert huge.tolist() == BlockPlan(idx, 18, 512, 40, np.random.default_rng(3)).take(0, len(idx)).tolist()
    assert sorted(huge.tolist()) == idx.tolist()
