"""Mixing stores by weight (``weights=[0.7, 0.3]``): every epoch takes a fixed share of its samples from each
store of a set, whatever the stores' sizes (the exact semantics: docs/api.md, "Mixing stores by weight").
numpy only; no torch.

Part ``i`` gives exactly ``k_i`` samples to every epoch (its share of ``N``, by largest remainder), drawn from
successive seeded permutations of its samples (none repeats before all were drawn); the epoch's samples come in
one random permutation, cut into batches sorted by index.  Random order only: the others are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lmdbstore.config import LoaderConfig
from lmdbstore.loader.orders import epoch_rng
from lmdbstore.loader.samplers import EpochBatchSampler, normalized_weights
from lmdbstore.store.metaview import sample_indices
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import Reader

__all__ = ["STREAM_MIX", "MixedBatchSampler", "mix_counts", "normalized_weights", "store_parts"]

#: Seed stream of the per-part permutations (apart from the epoch orders' streams).
STREAM_MIX = 11


def mix_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """``total`` split by ``weights`` (normalized without overflow: :func:`normalized_weights`) into integer
    counts by largest remainder; they sum to ``total`` exactly.

    Raises:
        ValueError: weights that are not finite, are negative or are all 0.
    """
    share = normalized_weights(weights) * total
    counts = np.floor(share).astype(np.int64)
    rest = total - int(counts.sum())
    if rest:
        counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
    return counts


def store_parts(store: Reader, indices: Any = None) -> list[np.ndarray]:
    """``indices`` (default: every sample) split by the store of a set they belong to, in store order (one part
    for a single store): the ``parts`` of a :class:`MixedBatchSampler` that weighs stores."""
    n = len(store)
    idx = np.arange(n, dtype=np.int64) if indices is None else sample_indices(indices)
    if not isinstance(store, StoreSet):
        return [idx]
    which = store.store_of(idx)
    return [idx[which == i] for i in range(len(store.readers))]


class MixedBatchSampler(EpochBatchSampler):
    """Batches that take fixed shares of every epoch from several parts (see the module docstring).

    Args:
        parts, weights: per store (:func:`store_parts`), the sample indices it may draw from, and its weight.
        epoch_samples: samples per epoch (default: all the parts' samples together).
        batch_size, seed, rank, world_size, drop_last: as :class:`~lmdbstore.loader.samplers.EpochBatchSampler`.

    Raises:
        ValueError: not one weight per part, bad weights, a part with a positive weight and no samples, a
            non-positive ``epoch_samples`` or ``batch_size``.
    """

    def __init__(
        self,
        parts: Sequence[Sequence[int] | np.ndarray],
        weights: Sequence[float],
        batch_size: int,
        *,
        epoch_samples: int | None = None,
        seed: int = LoaderConfig.seed,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ):
        self.parts = [sample_indices(p) for p in parts]
        if len(weights) != len(self.parts):
            raise ValueError(f"weights: {len(weights)} numbers for {len(self.parts)} stores, give one per store")
        total = sum(len(p) for p in self.parts) if epoch_samples is None else epoch_samples
        if total < 1:
            raise ValueError(f"epoch_samples must be positive, got {total}")
        self.counts = mix_counts(weights, total)
        self.weights = normalized_weights(weights)
        for i, (part, k) in enumerate(zip(self.parts, self.counts, strict=True)):
            if k and not len(part):
                raise ValueError(f"weights: store {i} has weight {weights[i]} but no samples to draw from")
        self.total = int(total)
        every = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)
        super().__init__(every, batch_size, shuffle="random", seed=seed, rank=rank, world_size=world_size,
                         drop_last=drop_last)  # fmt: skip

    def fingerprint(self) -> dict[str, Any]:
        counts = [int(c) for c in self.counts]  # each store's share of an epoch: the weights as drawn
        return {"kind": "mixed", "seed": self.seed, "batch_size": self.batch_size, "samples": self.total,
                "counts": counts}  # fmt: skip

    def draw(self, part: int, epoch: int) -> np.ndarray:
        """The samples part ``part`` gives to ``epoch`` (its window of the part's permutation stream)."""
        k, src = int(self.counts[part]), self.parts[part]
        n = len(src)
        if not k:
            return np.zeros(0, np.int64)
        lo, hi = epoch * k, (epoch + 1) * k
        pieces = []
        for c in range(lo // n, (hi - 1) // n + 1):
            perm = np.random.default_rng([self.seed, STREAM_MIX, part, c]).permutation(n)
            pieces.append(src[perm[max(lo - c * n, 0) : min(hi - c * n, n)]])
        return np.concatenate(pieces)

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The whole order of ``epoch`` (default: the current one), before sharding."""
        e = self.epoch if epoch is None else epoch
        order = np.concatenate([self.draw(i, e) for i in range(len(self.parts))])
        epoch_rng(self.seed, e).shuffle(order)  # = order[rng.permutation(n)], draw for draw, in place
        return order

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's batches of ``epoch``, each sorted (grouped by store)."""
        return [np.sort(b) for b in super().batches(epoch)]

    def __len__(self) -> int:
        step = self.batch_size * self.world_size
        return self.total // step if self.drop_last else -(-self.total // step)
