"""Epoch orders over a set of stores (:class:`~lmdbstore.store.multi.StoreSet`): the block and window orders keep
each store's packed values whole, and every batch comes grouped by store, so the set reads each store's part
straight into its rows.

The samplers group samples by ``index // samples_per_value``; in the set's index space a later store starts
inside a value's worth of indices, so :class:`SetSpace` moves every store up to a value boundary (the *padded*
space); samplers work on padded indices, and :class:`SetBatches` maps their batches back and groups them by
store.  For one store nothing changes.  numpy only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from lmdbstore.store.metaview import sample_indices
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import Reader

__all__ = ["SetBatches", "SetPrefetch", "SetSpace", "grouped", "set_space"]


class SetSpace:
    """The padded index space of a set of stores of ``counts`` samples: store ``i`` starts at ``padded[i]``, a
    multiple of ``samples_per_value`` (the samplers' grouping), instead of at ``offsets[i]``."""

    def __init__(self, counts: list[int], samples_per_value: int) -> None:
        c = np.asarray(counts, np.int64)
        spv = max(1, int(samples_per_value))
        self.offsets = np.r_[0, np.cumsum(c)].astype(np.int64)
        self.padded = np.r_[0, np.cumsum(-(-c // spv) * spv)].astype(np.int64)

    def _shift(self, idx: Any, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        a = sample_indices(idx, flat=False)
        i = np.searchsorted(src, a, side="right") - 1
        return a - src[i] + dst[i]

    def to_padded(self, indices: Any) -> np.ndarray:
        """Set indices -> padded indices."""
        return self._shift(indices, self.offsets, self.padded)

    def to_set(self, padded: Any) -> np.ndarray:
        """Padded indices (of samples, never of the gaps) -> set indices."""
        return self._shift(padded, self.padded, self.offsets)


def set_space(reader: Reader) -> SetSpace | None:
    """The padded space of a set of several stores; ``None`` for one store (nothing to pad)."""
    if not isinstance(reader, StoreSet) or len(reader.readers) == 1:
        return None
    return SetSpace(reader.counts, reader.meta.samples_per_value)


class SetPrefetch:
    """The window sampler's ``prefetch(lo, hi)`` for a set: ranges of padded indices, read ahead by ``reader``
    (a range whose ends are samples covers the same samples as the set range between them)."""

    def __init__(self, reader: StoreSet, space: SetSpace | None) -> None:
        self.reader, self.space = reader, space

    def __call__(self, lo: np.ndarray, hi: np.ndarray) -> None:
        if self.space is not None:
            lo, hi = self.space.to_set(lo), self.space.to_set(np.asarray(hi) - 1) + 1
        self.reader.prefetch(lo, hi)


class SetBatches:
    """A batch sampler over a set: the batches of ``inner`` (drawn over padded indices when ``space`` is given),
    as set indices grouped by store (stable: the order within a store is kept).

    Everything else -- ``set_epoch``, ``batch_size``, ``len`` -- is the inner sampler's.
    """

    def __init__(self, inner: Any, reader: StoreSet, space: SetSpace | None = None) -> None:
        self.inner, self.reader, self.space = inner, reader, space

    def __iter__(self) -> Iterator[np.ndarray]:
        return map(self._grouped, self.inner)

    def batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The inner sampler's batches of ``epoch`` from batch ``start`` on, mapped and grouped as a pass's."""
        return map(self._grouped, self.inner.batches_from(epoch, start))

    def _grouped(self, batch: Any) -> np.ndarray:
        b = self.space.to_set(batch) if self.space is not None else sample_indices(batch)
        return b[np.argsort(self.reader.store_of(b), kind="stable")]

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        """Select the inner sampler's order of ``epoch``."""
        self.inner.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "reader", "space"):  # not set yet (unpickling): not the inner sampler's
            raise AttributeError(name)
        return getattr(self.inner, name)


def grouped(sampler: Any, reader: Reader, space: SetSpace | None = None) -> Any:
    """``sampler`` as a :class:`SetBatches` over ``reader`` when it is a set of several stores, else itself."""
    if isinstance(reader, StoreSet) and len(reader.readers) > 1:
        return SetBatches(sampler, reader, space)
    return sampler
