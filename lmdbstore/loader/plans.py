"""Epoch orders made on demand: the first batch of a block or window epoch without building the whole order.

The orders are made of *pieces* (runs of consecutive indices: a piece of a packed value, a chunk of values), a
few hundred thousand entries, not millions of indices; only the slice a batch asks for is expanded.  They are
the whole orders draw for draw (docs/design.md#batch-orders).  numpy only.
"""

from __future__ import annotations

import numpy as np

from lmdbstore.loader.orders import concat_runs
from lmdbstore.store.metaview import sample_indices

__all__ = ["BlockPlan", "WindowSequence", "batch_bounds", "sorted_indices", "value_starts"]


#: Indices compared at a time when checking that they are sorted (a bounded temporary).
SORT_CHECK_CHUNK = 1 << 20


def sorted_indices(indices: np.ndarray) -> np.ndarray:
    """``indices`` as sorted int64 (no sort when they already are: a training split, ``arange``).  Checked
    :data:`SORT_CHECK_CHUNK` at a time, so the check's temporary stays small at any size."""
    idx = sample_indices(indices)
    for a in range(0, idx.size - 1, SORT_CHECK_CHUNK):
        b = min(a + SORT_CHECK_CHUNK, idx.size - 1)
        if not bool((idx[a + 1 : b + 1] >= idx[a:b]).all()):
            return np.sort(idx)
    return idx


def value_starts(idx: np.ndarray, spv: int) -> np.ndarray:
    """Positions in the sorted, non-empty ``idx`` where the samples of a new packed value begin (the first is 0):
    by a search for each value's first sample where the values spanned are fewer than the indices (an
    ``arange``: no pass of integer divisions and temporaries over all of them), else by comparing neighbours."""
    v0, v1 = int(idx[0]) // spv, int(idx[-1]) // spv
    if v1 - v0 < idx.size:
        pos = np.searchsorted(idx, np.arange(v0, v1 + 1, dtype=np.int64) * spv)
        return pos[np.r_[True, pos[1:] != pos[:-1]]]
    vals = idx // spv
    return np.flatnonzero(np.r_[True, vals[1:] != vals[:-1]])


def batch_bounds(n: int, batch_size: int, world_size: int = 1) -> np.ndarray:
    """Boundaries ``b`` of the batches :func:`~lmdbstore.loader.orders.deal_batches` cuts from an order of ``n``:
    batch ``j`` is ``order[b[j]:b[j + 1]]``."""
    if n == 0:
        return np.zeros(1, np.int64)
    if world_size == 1:
        return np.r_[np.arange(0, n, batch_size), n].astype(np.int64)
    k = -(-n // (batch_size * world_size)) * world_size
    q, r = divmod(n, k)  # np.array_split: the first r parts one longer
    sizes = np.full(k, q, np.int64)
    sizes[:r] += 1
    return np.r_[0, np.cumsum(sizes)].astype(np.int64)


class BlockPlan:
    """One epoch's block order (:func:`~lmdbstore.loader.samplers.block_order`) as pieces, expanded on demand:
    every draw is made up front (one ``rng.permutation`` of the values, one ``rng.random`` per piece), and a
    window's pieces are put in order only when a batch asks for them.  O(values) time and memory.
    """

    def __init__(
        self, indices: np.ndarray, samples_per_value: int, batch_size: int, block_buffer: int, rng: np.random.Generator
    ):
        self.idx = idx = sorted_indices(indices)
        n = idx.size
        self._windows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.keys: np.ndarray = np.zeros(0)  # each piece's draw of the second shuffle (none with block_buffer 1)
        self.src: np.ndarray = np.zeros(0, np.int64)  # each piece's first sample's position in idx
        self.lens: np.ndarray = np.zeros(0, np.int64)
        self.pos: np.ndarray = np.zeros(0, np.int64)  # where each piece starts before the second shuffle
        self.bounds: np.ndarray = np.zeros(1, np.int64)  # each window's first piece (and the end)
        if n == 0:
            return
        starts = value_starts(idx, samples_per_value)
        lengths = np.diff(np.r_[starts, n])
        perm = rng.permutation(len(starts))
        gs, gl = starts[perm], lengths[perm]
        if block_buffer <= 1:  # one piece per value, no second shuffle: one window
            self.src, self.lens = gs, gl
            self.bounds = np.array([0, len(gs)], np.int64)
            self.pos = np.r_[0, np.cumsum(gl)][:-1]
            return
        # piece k of a run of L samples: its samples j with j * block_buffer // L == k.  A value has at most
        # samples_per_value samples: from that many pieces on, every piece is one sample, so the pieces are cut
        # for at most that many (the same pieces, in the same order), column by column into the (run, piece)
        # tables (no temporary larger than one column); the windows below keep the block_buffer asked for.
        cols = min(block_buffer, samples_per_value)
        n_runs = len(gl)
        psrc = np.empty((n_runs, cols), np.int64)
        plen = np.empty((n_runs, cols), np.int64)
        ppos = np.empty((n_runs, cols), np.int64)  # where the piece starts before the second shuffle
        run_pos = np.cumsum(gl)
        run_pos -= gl
        lo = np.zeros(n_runs, np.int64)
        for k in range(cols):
            hi = -(-((k + 1) * gl) // cols)
            np.add(gs, lo, out=psrc[:, k])
            np.subtract(hi, lo, out=plen[:, k])
            np.add(run_pos, lo, out=ppos[:, k])
            lo = hi
        del run_pos, lo, gs, gl
        src, lens, pos = psrc.reshape(-1), plen.reshape(-1), ppos.reshape(-1)
        if not bool((lens > 0).all()):  # runs shorter than the pieces leave empty ones
            keep = lens > 0
            src, lens, pos = src[keep], lens[keep], pos[keep]
        self.src, self.lens, self.pos = src, lens, pos
        self.keys = rng.random(len(self.pos))
        width = max(
            1, min(block_buffer * batch_size, n)
        )  # the pieces of window w start in [w * width, (w + 1) * width)
        firsts = np.searchsorted(self.pos, np.arange(0, int(self.pos[-1]) + 1, width, dtype=np.int64))
        self.bounds = np.r_[np.unique(firsts), len(self.pos)].astype(np.int64)

    def __len__(self) -> int:
        return int(self.idx.size)

    def _window(self, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Window ``w``'s pieces in their shuffled order: sources, lengths and the order position after each."""
        got = self._windows.get(w)
        if got is None:
            a, b = int(self.bounds[w]), int(self.bounds[w + 1])
            order = a + np.argsort(self.keys[a:b], kind="stable") if len(self.keys) else np.arange(a, b)
            lens = self.lens[order]
            got = (self.src[order], lens, int(self.pos[a]) + np.cumsum(lens))
            if len(self._windows) >= 2:  # batches move forward: keep the window in use and the one before
                self._windows.pop(min(self._windows))
            self._windows[w] = got
        return got

    def take(self, lo: int, hi: int) -> np.ndarray:
        """``order[lo:hi]`` of the epoch's order (``0 <= lo <= hi <= len``)."""
        if hi <= lo:
            return np.zeros(0, np.int64)
        starts = self.pos[self.bounds[:-1]]  # where each window begins in the order
        w0 = int(np.searchsorted(starts, lo, side="right")) - 1
        w1 = int(np.searchsorted(starts, hi, side="left")) - 1  # the window holding position hi - 1
        parts = []
        for w in range(w0, w1 + 1):
            src, lens, ends = self._window(w)
            a = int(np.searchsorted(ends, lo, side="right"))  # the piece holding position max(lo, window start)
            b = int(np.searchsorted(ends, hi, side="left"))
            b = min(b, len(ends) - 1)
            s, n = src[a : b + 1].copy(), lens[a : b + 1].copy()
            cut = max(0, lo - int(ends[a] - lens[a]))
            s[0] += cut
            n[0] -= cut
            n[-1] -= max(0, int(ends[b]) - hi)
            parts.append(concat_runs(self.idx, s, n))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def order(self) -> np.ndarray:
        """The whole order."""
        return self.take(0, len(self))


class WindowSequence:
    """One epoch's windowed order (see :mod:`lmdbstore.loader.window`), window by window.

    The chunks (runs of ``chunk_samples`` rounded up to whole values) are shuffled up front (one
    ``rng.permutation``, O(values)); each window's samples are put in order and shuffled (one ``rng.shuffle``)
    only when a batch first asks for them, in window order, as the eager order draws them.  ``window_starts``,
    ``chunk_lo`` and ``chunk_hi`` (what the read-ahead needs) are known from the start.
    """

    def __init__(
        self,
        indices: np.ndarray,
        samples_per_value: int,
        window_samples: int,
        chunk_samples: int,
        rng: np.random.Generator,
        first_window_samples: int | None = None,
    ):
        self.idx = idx = sorted_indices(indices)
        self.rng = rng
        self._made: dict[int, np.ndarray] = {}
        self._next = 0  # the next window to shuffle
        if idx.size == 0:
            self.window_starts = np.zeros(1, np.int64)
            self.chunk_lo: list[np.ndarray] = []
            self.chunk_hi: list[np.ndarray] = []
            self._bounds = np.zeros(1, np.int64)
            self._starts = self._lengths = np.zeros(0, np.int64)
            return
        per_chunk = max(1, -(-chunk_samples // samples_per_value))
        cstarts = value_starts(idx, samples_per_value)[::per_chunk]  # a chunk: per_chunk values
        clens = np.diff(np.r_[cstarts, idx.size])
        perm = rng.permutation(len(cstarts))
        starts, lengths = cstarts[perm], clens[perm]
        chunk_len = max(1, per_chunk * samples_per_value)
        per_window = max(1, window_samples // chunk_len)
        first = (
            per_window if first_window_samples is None else min(per_window, max(1, first_window_samples // chunk_len))
        )
        bounds = np.unique(np.r_[0, np.arange(first, len(starts), per_window), len(starts)])  # in chunks
        self.window_starts = np.r_[0, np.cumsum(lengths)][bounds].astype(np.int64)
        lo_all, hi_all = idx[starts], idx[starts + lengths - 1] + 1
        self.chunk_lo = [np.sort(lo_all[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)]
        self.chunk_hi = [np.sort(hi_all[a:b]) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)]
        self._bounds, self._starts, self._lengths = bounds, starts, lengths

    def __len__(self) -> int:
        return int(self.idx.size)

    @property
    def begun(self) -> bool:
        """Whether a window was shuffled already (the generator moved on)."""
        return self._next > 0

    def window(self, w: int) -> np.ndarray:
        """Window ``w``'s samples in order (the windows before it are shuffled first; only the latest two are
        kept, so windows are asked for in order)."""
        while self._next <= w:
            k = self._next
            a, b = int(self._bounds[k]), int(self._bounds[k + 1])
            part = concat_runs(self.idx, self._starts[a:b], self._lengths[a:b])
            self.rng.shuffle(part)  # uniform within the window
            self._made[k] = part
            self._made.pop(k - 2, None)
            self._next += 1
        return self._made[w]

    def take(self, lo: int, hi: int) -> np.ndarray:
        """``order[lo:hi]`` of the epoch's order (asked for in increasing positions)."""
        if hi <= lo:
            return np.zeros(0, np.int64)
        ws = self.window_starts
        w0 = int(np.searchsorted(ws, lo, side="right")) - 1
        w1 = int(np.searchsorted(ws, hi, side="left")) - 1
        parts = [
            self.window(w)[max(lo, int(ws[w])) - int(ws[w]) : min(hi, int(ws[w + 1])) - int(ws[w])]
            for w in range(w0, w1 + 1)
        ]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def order(self) -> np.ndarray:
        """The whole order (every window shuffled)."""
        return self.take(0, len(self))
