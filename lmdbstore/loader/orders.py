"""Building blocks of the epoch orders, shared by the samplers and the windowed shuffle: the one seeded stream
per ``(seed, epoch, purpose)`` every order draws from (:func:`epoch_rng`: an order depends on nothing else, not
the worker count, not the rank), runs gathered without a Python loop, batches dealt to the ranks.  numpy only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["STREAM_BALANCED", "STREAM_WINDOW", "concat_runs", "deal_batches", "epoch_rng"]

#: :func:`epoch_rng` streams besides the plain epoch order (0): class-balanced draws (plus the rank: each
#: rank draws its own batches) and the windowed order.
STREAM_BALANCED = 1
STREAM_WINDOW = 7


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The generator of ``epoch`` under ``seed``; ``stream`` keeps purposes apart (default 0: the plain epoch
    order; each sampler kind and rank that draws on its own uses another)."""
    return np.random.default_rng([seed, epoch, stream])


def concat_runs(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([src[a:a+n] for a, n in zip(starts, lengths)])`` without a Python loop."""
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return src[np.repeat(starts, lengths) + offsets]


def deal_batches(order: np.ndarray, batch_size: int, world_size: int = 1) -> list[np.ndarray]:
    """Every rank's batches of an epoch order, interleaved: batch ``j`` belongs to rank ``j % world_size``.

    One process gets plain consecutive batches of ``batch_size`` (the last one shorter).  Several get
    ``steps * world_size`` nearly equal batches (sizes differ by at most one, none above ``batch_size``), so
    every rank runs the same number of steps -- DDP needs that -- and every sample is read exactly once,
    with no padding and no dropped tail.
    """
    n = len(order)
    if n == 0:
        return []
    if world_size == 1:
        return [order[i : i + batch_size] for i in range(0, n, batch_size)]
    steps = -(-n // (batch_size * world_size))
    return list(np.array_split(order, steps * world_size))
