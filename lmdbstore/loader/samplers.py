"""Epoch orders and batch samplers: full random, block (quasi-random), class-balanced, DDP sharding.

Every sampler yields whole batches as ``int64`` numpy arrays of sample indices.  The order of epoch ``e``
depends only on ``(seed, e)`` and is the same on every DDP rank; each rank takes its own disjoint share
(:func:`shard_batches`).  Passes, epochs and resuming: :mod:`lmdbstore.loader.passes`.  numpy only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from lmdbstore.config import LoaderConfig, ShuffleMode
from lmdbstore.loader.orders import STREAM_BALANCED, deal_batches, epoch_rng
from lmdbstore.loader.passes import EpochPasses
from lmdbstore.loader.plans import BlockPlan, batch_bounds
from lmdbstore.store.metaview import sample_indices
from lmdbstore.util.splits import check_val_fraction

__all__ = [
    "BalancedBatchSampler",
    "EpochBatchSampler",
    "block_order",
    "normalized_weights",
    "shard_batches",
    "stratified_split",
]


def block_order(
    indices: np.ndarray, samples_per_value: int, batch_size: int, block_buffer: int, rng: np.random.Generator
) -> np.ndarray:
    """Quasi-random order that keeps the samples of one packed value together in short runs: the values are
    shuffled, each cut into ``block_buffer`` pieces, the pieces shuffled within windows of ``block_buffer *
    batch_size`` samples; a batch needs about ``block_buffer * batch_size / samples_per_value`` lookups.
    """
    return BlockPlan(indices, samples_per_value, batch_size, block_buffer, rng).order()


def shard_batches(order: np.ndarray, batch_size: int, rank: int = 0, world_size: int = 1) -> list[np.ndarray]:
    """Cut an epoch order into batches and return rank ``rank``'s share (every ``world_size``-th batch of
    :func:`~lmdbstore.loader.orders.deal_batches`: consecutive batches for one process, nearly equal ones
    and the same number of steps on every rank under DDP; every sample exactly once, no padding).

    Raises:
        ValueError: ``rank`` outside ``0..world_size-1``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..world_size-1, got rank={rank}, world_size={world_size}")
    return deal_batches(order, batch_size, world_size)[rank::world_size]


class EpochBatchSampler(EpochPasses):
    """Batches that cover ``indices`` exactly once per epoch, in random or block order.

    Args:
        indices, batch_size: the sample indices to draw from; samples per batch on this rank.
        shuffle: ``"random"`` (a fresh permutation each epoch), ``"block"`` (see :func:`block_order`; with the
            store's ``samples_per_value`` and ``block_buffer``) or ``"none"`` (the given order).
        seed: base seed.  Each pass takes the next epoch's order; :meth:`set_epoch` pins one.
        rank, world_size: this process's share under DDP (default: ``torch.distributed``'s process group, if any).
        drop_last: leave out the final short batch (with several ranks, the tail that would not give every rank
            a full batch).

    Raises:
        ValueError: a non-positive ``batch_size``, an unknown ``shuffle``, a ``rank`` outside the world.
    """

    def __init__(
        self,
        indices: Sequence[int] | np.ndarray,
        batch_size: int,
        *,
        shuffle: ShuffleMode | Literal["none"] = "random",
        samples_per_value: int = 1,
        block_buffer: int = 2,
        seed: int = LoaderConfig.seed,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if shuffle not in ("random", "block", "none"):
            raise ValueError(f"shuffle must be 'random', 'block' or 'none', got {shuffle!r}")
        self.indices = sample_indices(indices)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.samples_per_value = samples_per_value
        self.block_buffer = block_buffer
        self.seed = seed
        self.drop_last = drop_last
        self.init_passes(rank, world_size)

    def fingerprint(self) -> dict[str, Any]:
        out = {"kind": self.shuffle, "seed": self.seed, "batch_size": self.batch_size, "samples": len(self.indices)}
        if self.shuffle == "block":
            out.update(samples_per_value=self.samples_per_value, block_buffer=self.block_buffer)
        return out

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The whole order of ``epoch`` (default: the current one), before sharding (identical on every
        rank)."""
        rng = epoch_rng(self.seed, self.epoch if epoch is None else epoch)
        if self.shuffle == "random":
            order = self.indices.copy()
            rng.shuffle(order)  # = indices[rng.permutation(n)], draw for draw, without the permutation's copy
            return order
        if self.shuffle == "block":
            return block_order(self.indices, self.samples_per_value, self.batch_size, self.block_buffer, rng)
        return self.indices.copy()

    def whole_steps(self, order: np.ndarray) -> np.ndarray:
        """``order`` cut to whole steps of every rank when ``drop_last`` (a per-rank drop would leave the
        ranks unequal); unchanged otherwise."""
        if not self.drop_last:
            return order
        step = self.batch_size * self.world_size
        return order[: len(order) // step * step]

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` (default: the current one), without beginning a pass."""
        if self.shuffle == "block":
            return list(self._block_batches(self.epoch if epoch is None else epoch, 0))
        order = self.epoch_order(epoch)
        return shard_batches(self.whole_steps(order), self.batch_size, self.rank, self.world_size)

    def batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        if self.shuffle == "block":  # made as they are asked for: the first batch does not wait for the epoch
            return self._block_batches(epoch, start)
        return iter(self.batches(epoch)[start:])

    def _block_batches(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """This rank's block-order batches of ``epoch`` from batch ``start`` on, each expanded from the epoch's
        pieces when it is asked for (:class:`~lmdbstore.loader.plans.BlockPlan`; the same batches as cutting
        :meth:`epoch_order`), sorted: its runs are contiguous, and the reader copies each in one go."""
        rng = epoch_rng(self.seed, epoch)
        plan = BlockPlan(self.indices, self.samples_per_value, self.batch_size, self.block_buffer, rng)
        n, step = len(plan), self.batch_size * self.world_size
        bounds = batch_bounds(n // step * step if self.drop_last else n, self.batch_size, self.world_size).tolist()
        rank, world = self.rank, self.world_size
        for j in range(rank + start * world, len(bounds) - 1, world):
            yield np.sort(plan.take(bounds[j], bounds[j + 1]))

    def __len__(self) -> int:
        n, step = len(self.indices), self.batch_size * self.world_size
        return n // step if self.drop_last else -(-n // step)


class BalancedBatchSampler(EpochPasses):
    """Batches that draw classes in fixed proportions (equal by default), with replacement.

    Args:
        class_indices: per class, the sample indices it may draw from.
        batch_size: samples per batch on this rank.
        weights: relative share of each class (default equal); classes with weight 0 are never drawn.
        num_batches: batches per epoch on this rank (default: as many as a plain epoch's).
        seed, rank, world_size: as for :class:`EpochBatchSampler`; ranks draw disjoint random streams.
        class_names: names for error messages (default: the class numbers).

    Raises:
        ValueError: a class with positive weight has no samples, or the weights are invalid.
    """

    #: Draws with replacement: a batch may be larger than the samples it draws from.
    with_replacement = True

    def __init__(
        self,
        class_indices: Sequence[np.ndarray],
        batch_size: int,
        *,
        weights: Sequence[float] | None = None,
        num_batches: int | None = None,
        seed: int = LoaderConfig.seed,
        rank: int | None = None,
        world_size: int | None = None,
        class_names: Sequence[str] | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.class_indices = [sample_indices(c) for c in class_indices]
        k = len(self.class_indices)
        w = np.ones(k) if weights is None else np.asarray(weights, dtype=np.float64)
        if w.shape != (k,):
            raise ValueError(f"weights must be {k} numbers, one per class, got {weights!r}")
        w = normalized_weights(w)  # without overflow; finite, non-negative, not all 0
        names = list(class_names) if class_names is not None else [str(i) for i in range(k)]
        for c in range(k):
            if w[c] > 0 and len(self.class_indices[c]) == 0:
                raise ValueError(f"class {names[c]!r} has no samples to draw from; balanced sampling needs every class")
        self.weights = w
        self.batch_size = batch_size
        self.seed = seed
        self.init_passes(rank, world_size)
        self.total = sum(len(c) for c in self.class_indices)
        self._num_batches = num_batches

    @property
    def num_batches(self) -> int:
        """Batches per epoch on this rank (default: a plain epoch's over all the given indices)."""
        if self._num_batches is not None:
            return self._num_batches
        return max(1, -(-self.total // (self.batch_size * self.world_size)))

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "balanced", "seed": self.seed, "batch_size": self.batch_size, "samples": self.total}

    def __len__(self) -> int:
        return self.num_batches

    def batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        rng = epoch_rng(self.seed, epoch, STREAM_BALANCED + self.rank)
        for i in range(self.num_batches):
            counts = rng.multinomial(self.batch_size, self.weights)
            parts = [
                self.class_indices[c][rng.integers(0, len(self.class_indices[c]), n)] for c, n in enumerate(counts) if n
            ]
            batch = np.concatenate(parts)
            rng.shuffle(batch)
            if i >= start:  # the skipped ones are drawn all the same: the stream must advance
                yield batch


def normalized_weights(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """``weights`` as float64 shares summing to 1, computed without overflow: divided by their largest first, so
    that finite weights whose sum is not finite (``[1e308, 1e308]``) still give ``[0.5, 0.5]``.

    Raises:
        ValueError: weights that are not finite, are negative, or are all 0.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if not w.size or not np.isfinite(w).all() or (w < 0).any() or not w.max() > 0:
        raise ValueError(f"weights must be finite non-negative numbers, not all 0, got {list(weights)!r}")
    w = w / w.max()  # in [0, 1]: the sum is at most len(w)
    return w / w.sum()


def stratified_split(
    labels: np.ndarray, val_fraction: float, seed: int = LoaderConfig.seed
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded train/validation split that holds out ``val_fraction`` of every class: a share in ``[0, 1)``, or a
    count ``>= 2`` held out in proportion to the classes (by largest remainder).  Returns ``(train_indices,
    val_indices)``, both sorted; a class of at least two samples keeps one in each part.  No sort of the labels.
    """
    check_val_fraction(val_fraction)
    labels = np.asarray(labels).reshape(-1)
    if val_fraction >= 1 and val_fraction >= len(labels):
        raise ValueError(
            f"val_fraction: {int(val_fraction)} validation samples leave none of {len(labels)} to train on"
        )
    rng = np.random.default_rng([seed, 0x5A17])
    val_parts: list[np.ndarray] = []
    classes = _class_counts(labels)
    for (c, n_c), n_val in zip(classes, _held_out([n for _, n in classes], val_fraction), strict=True):
        if val_fraction > 0 and n_c >= 2:
            n_val = min(max(n_val, 1), n_c - 1)
        pick = rng.choice(n_c, size=n_val, replace=False)  # the draws rng.choice(members, ...) makes
        if n_val:
            val_parts.append(np.flatnonzero(labels == c)[pick])  # members in index order: the stable sort's
    val = np.concatenate(val_parts).astype(np.int64, copy=False) if val_parts else np.zeros(0, np.int64)
    del val_parts
    val.sort()
    return _complement(val, len(labels)), val


def _held_out(counts: list[int], val_fraction: float) -> list[int]:
    """Each class's validation samples before the at-least-one-each-side rule: ``round(n * share)`` for a share,
    a count split in proportion to the classes by largest remainder (they sum to the count)."""
    if val_fraction < 1:
        return [round(n * val_fraction) for n in counts]
    total = sum(counts)
    share = np.asarray(counts, np.float64) * (int(val_fraction) / total)
    out = np.floor(share).astype(np.int64)
    rest = int(val_fraction) - int(out.sum())
    if rest > 0:
        out[np.argsort(-(share - out), kind="stable")[:rest]] += 1
    return out.tolist()


#: Indices :func:`_complement` handles at a time (a bounded temporary, not a mask of the whole table).
COMPLEMENT_CHUNK = 1 << 18


def _complement(val: np.ndarray, n: int) -> np.ndarray:
    """``0..n-1`` without the sorted, distinct ``val``, sorted (int64), made :data:`COMPLEMENT_CHUNK` at a time."""
    out = np.empty(n - len(val), np.int64)
    done = 0
    for a in range(0, n, COMPLEMENT_CHUNK):
        b = min(a + COMPLEMENT_CHUNK, n)
        keep = np.ones(b - a, bool)
        keep[val[np.searchsorted(val, a) : np.searchsorted(val, b)] - a] = False
        part = np.flatnonzero(keep)
        np.add(part, a, out=out[done : done + len(part)])
        done += len(part)
    return out


def _class_counts(labels: np.ndarray) -> list[tuple[Any, int]]:
    """``(label, count)`` of every label present, in ascending label order: by ``bincount`` for small
    non-negative integers, :data:`COMPLEMENT_CHUNK` labels at a time (``bincount`` makes an int64 copy of what it
    counts), else by ``np.unique``."""
    if labels.size and labels.dtype.kind in "ui" and int(labels.min()) >= 0 and int(labels.max()) < 1 << 16:
        counts = np.zeros(int(labels.max()) + 1, np.int64)
        for a in range(0, labels.size, COMPLEMENT_CHUNK):
            part = np.bincount(labels[a : a + COMPLEMENT_CHUNK])
            counts[: len(part)] += part
        return [(c, int(counts[c])) for c in np.flatnonzero(counts).tolist()]
    values, counts = np.unique(labels, return_counts=True)
    return list(zip(values.tolist(), counts.tolist(), strict=True))
