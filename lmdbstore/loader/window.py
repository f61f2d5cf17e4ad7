"""A shuffle for stores bigger than RAM: random batches drawn from a window of large consecutive runs
(docs/design.md#window-shuffle).

The windowed order takes *chunks* of consecutive values (large sequential reads) in a random order, gathers
``window`` bytes' worth of them, and permutes all samples of that window uniformly; batches are cut from the
result, and the ``prefetch`` hook reads the next window into the page cache meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmdbstore.config import LoaderConfig
from lmdbstore.loader.orders import STREAM_WINDOW, epoch_rng
from lmdbstore.loader.plans import WindowSequence, batch_bounds
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.util.memory import available_memory, clip_bytes  # available_memory re-exported: one reading

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SHARED_WINDOW_BYTES",
    "ShuffleChoice",
    "WindowBatchSampler",
    "available_memory",
    "bound_window_bytes",
    "choose_shuffle",
    "default_window_bytes",
]

#: Bytes of consecutive values read as one chunk (one large sequential read).
DEFAULT_CHUNK_BYTES = 4 << 20
#: Share of available memory one window takes (the next one is prefetched beside it; the first one of an
#: epoch has to be read before its batches run at full speed, so it is kept modest).
WINDOW_SHARE = 0.125
#: The default window of ranks that share one order (``world_size`` > 1): one size on every rank, whatever memory
#: each has free (windows of different sizes are different orders: their shares would overlap).
SHARED_WINDOW_BYTES = 1 << 30
#: The first window of an epoch is at most this large, so that training starts after a short read (the
#: next, full-size window is prefetched while it is consumed).
FIRST_WINDOW_BYTES = 256 << 20
#: A window gathers at least this many chunks (chunks shrink for small windows), so that its class mix is
#: close to the store's even when the store was written one class after another.
MIN_CHUNKS_PER_WINDOW = 256
#: Share of available memory the page cache may give a store that is read at random.
CACHE_SHARE = 0.8

Prefetch = Callable[[np.ndarray, np.ndarray], None]


def bound_window_bytes(
    window_bytes: int, data_bytes: int, parameter: str = "window_bytes", available: int | None = None
) -> int:
    """``window_bytes`` bounded by the machine: a window holding more of the data (``data_bytes``) than half the
    available memory would evict itself while read ahead, so it is clipped, with a
    :class:`~lmdbstore.util.memory.MemoryBoundWarning` naming ``parameter``.

    Raises:
        ValueError: ``window_bytes`` not positive.
    """
    if window_bytes < 1:
        raise ValueError(f"{parameter} must be positive, got {window_bytes}")
    holds = min(window_bytes, max(data_bytes, 1))
    fits = clip_bytes(holds, what="a window", parameter=parameter, available=available, stacklevel=4)
    return window_bytes if fits == holds else fits


def default_window_bytes(available: int | None = None) -> int:
    """An eighth of available memory (at least 64 MiB) rounded down to a power of two: the window plus the one
    prefetched beside it.  Rounded, so that processes of one machine (a resumed run, the ranks of a job) that read
    slightly different free memory still get one size; the trainer records the size it used all the same."""
    avail = available_memory() if available is None else available
    return max(64 << 20, 1 << (max(1, int(avail * WINDOW_SHARE)).bit_length() - 1))


@dataclass(frozen=True)
class ShuffleChoice:
    """What :func:`choose_shuffle` picked and why (one line for the user)."""

    shuffle: str
    reason: str


def choose_shuffle(store_bytes: int, available: int | None = None) -> ShuffleChoice:
    """``random`` if the store fits in the page-cache budget (80 % of available memory), else ``window``."""
    avail = available_memory() if available is None else available
    budget = int(avail * CACHE_SHARE)
    gib = 1 << 30
    if store_bytes <= budget:
        return ShuffleChoice(
            "random", f"store {store_bytes / gib:.1f} GiB fits the page cache ({budget / gib:.1f} GiB)"
        )
    return ShuffleChoice("window", f"store {store_bytes / gib:.1f} GiB exceeds the page cache ({budget / gib:.1f} GiB)")


class WindowBatchSampler(EpochBatchSampler):
    """Batches in windowed order (``shuffle="window"``), covering ``indices`` once per epoch.

    Args:
        indices, batch_size, seed, rank, world_size, drop_last: as for
            :class:`~lmdbstore.loader.samplers.EpochBatchSampler`.
        samples_per_value, sample_bytes: the store's packing and sample size.
        window_bytes: sample bytes per window (default :func:`default_window_bytes`; with ``world_size`` > 1,
            :data:`SHARED_WINDOW_BYTES`, one size on every rank), clipped by :func:`bound_window_bytes`.
        chunk_bytes: bytes of consecutive values per chunk (default 4 MiB; less when the first window, at most
            256 MiB, would hold fewer than 256 chunks).
        prefetch: ``prefetch(lo, hi)`` with the sample ranges of the next window when one starts (e.g.
            :meth:`~lmdbstore.store.reader.StoreReader.prefetch`).

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(
        self,
        indices: Sequence[int] | np.ndarray,
        batch_size: int,
        *,
        samples_per_value: int,
        sample_bytes: int,
        window_bytes: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        prefetch: Prefetch | None = None,
        seed: int = LoaderConfig.seed,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ):
        super().__init__(
            indices, batch_size, shuffle="none", seed=seed, rank=rank, world_size=world_size, drop_last=drop_last
        )
        self.shuffle = "window"  # type: ignore[assignment]
        for name, v in (("samples_per_value", samples_per_value), ("sample_bytes", sample_bytes)):
            if v < 1:
                raise ValueError(f"{name} must be positive, got {v}")
        if chunk_bytes < 1 or (window_bytes is not None and window_bytes < 1):
            raise ValueError(f"window_bytes and chunk_bytes must be positive, got {window_bytes}, {chunk_bytes}")
        if window_bytes is None and self.world_size == 1:
            window_bytes = default_window_bytes()
        else:  # ranks sharing one order need one window size: a fixed default, not each rank's free memory
            window_bytes = bound_window_bytes(window_bytes or SHARED_WINDOW_BYTES, len(self.indices) * sample_bytes)
        self.samples_per_value = samples_per_value
        self.window_bytes = window_bytes  # as made: a run records it (its default depends on the memory free now)
        self.window_samples = max(1, window_bytes // sample_bytes)
        self.first_window_samples = max(1, min(window_bytes, FIRST_WINDOW_BYTES) // sample_bytes)
        first_bytes = self.first_window_samples * sample_bytes
        self.chunk_samples = max(1, min(chunk_bytes, first_bytes // MIN_CHUNKS_PER_WINDOW) // sample_bytes)
        self.prefetch = prefetch
        self._ahead: tuple[int, WindowSequence] | None = None  # the next epoch's order, made by the read-ahead

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "window_samples": self.window_samples, "chunk_samples": self.chunk_samples}

    def plan(self, epoch: int | None = None) -> WindowSequence:
        """The windowed order of ``epoch`` (default: the current one; identical on every rank), made window by
        window (:class:`~lmdbstore.loader.plans.WindowSequence`): the one the read-ahead made for the next epoch if
        it is still unused, else a new one."""
        return self._sequence(self.epoch if epoch is None else epoch)[0]

    def _sequence(self, epoch: int) -> tuple[WindowSequence, bool]:
        """:meth:`plan`, and whether the read-ahead made it (its first window is being read already)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == epoch and not ahead[1].begun:
            return ahead[1], True
        rng = epoch_rng(self.seed, epoch, STREAM_WINDOW)
        args = (self.indices, self.samples_per_value, self.window_samples, self.chunk_samples, rng)
        return WindowSequence(*args, self.first_window_samples), False

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        return self.plan(epoch).order()

    def batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """This rank's batches of ``epoch`` from batch ``start`` on, each cut from its window when asked for, reading
        ahead: the window of the first one when the pass begins, each next window as soon as a batch comes from
        the one before, and in the last window the next epoch's first (no cold start at the epoch boundary)."""
        seq, ahead = self._sequence(epoch)
        rank, world = self.rank, self.world_size
        step = self.batch_size * world
        n = len(seq) // step * step if self.drop_last else len(seq)
        bounds = batch_bounds(n, self.batch_size, world).tolist()
        n_win = len(seq.chunk_lo)
        fetched = 0 if ahead and start == 0 else -1  # the read-ahead is reading its first window already
        for j in range(rank + start * world, len(bounds) - 1, world):
            w = min(int(np.searchsorted(seq.window_starts, bounds[j], side="right")) - 1, n_win - 1)  # empty: last
            if self.prefetch is not None and fetched < w:  # the pass's first window
                fetched = w
                self.prefetch(seq.chunk_lo[w], seq.chunk_hi[w])
            if self.prefetch is not None and w + 1 < n_win and fetched < w + 1:
                fetched = w + 1
                self.prefetch(seq.chunk_lo[fetched], seq.chunk_hi[fetched])
            batch = seq.take(bounds[j], bounds[j + 1])
            if self.prefetch is not None and w + 1 >= n_win and fetched < n_win:
                fetched = n_win
                self._read_ahead(epoch + 1)
            yield batch

    def _read_ahead(self, epoch: int) -> None:
        """Start reading ``epoch``'s first window, and keep its order for that epoch's pass."""
        seq = self.plan(epoch)
        self._ahead = (epoch, seq)
        if seq.chunk_lo and self.prefetch is not None:
            self.prefetch(seq.chunk_lo[0], seq.chunk_hi[0])

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        return list(self.batches_from(self.epoch if epoch is None else epoch, 0))
