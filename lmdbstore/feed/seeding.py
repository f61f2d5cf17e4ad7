"""The random generators a batch's user code sees (a transform, a dataset's ``__getitem__``): seeded per batch
from the run's seed, the batch's epoch and its number in the epoch.

Forked reader processes start with a copy of the consumer's generators, so without this every reader draws
the same "random" augmentation (a transform drawing from ``np.random`` repeated 20 of 40 draws across two
readers).  Seeding per batch rather than per reader also makes the draws independent of how many readers
there are and of where a run was resumed: batch ``b`` of epoch ``e`` draws the same in every run with the same
seed.  ``random``, numpy's global generator and -- only where the process has imported it -- torch's CPU
generator are seeded (``np.random.default_rng()`` without a seed takes fresh entropy, as always).

In a reader process the generators are the feed's own; in the consumer's process (no readers) they are the
program's, so there they are put back after the batch (:func:`seeded` with ``restore=True``).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["BatchSeed", "batch_seeds", "seeded"]

#: ``(run seed, epoch, batch number in the epoch)``.
BatchSeed = tuple[int, int, int]


def batch_seeds(seed: BatchSeed) -> tuple[int, np.ndarray, int]:
    """The seeds of ``random``, numpy (a 4-word key) and torch for one batch: independent streams of one
    ``SeedSequence`` of the batch's key."""
    run, epoch, batch = seed
    words = np.random.SeedSequence(entropy=run & (2**128 - 1), spawn_key=(epoch, batch)).generate_state(8)
    return int(words[0]) << 32 | int(words[1]), words[2:6], int(words[6]) << 32 | int(words[7])


@contextlib.contextmanager
def seeded(seed: BatchSeed | None, *, restore: bool) -> Iterator[None]:
    """Run the block with ``random``, numpy's global generator and torch's (if imported) seeded for ``seed``
    (``None``: as they are); ``restore``: put their states back afterwards."""
    if seed is None:
        yield
        return
    torch: Any = sys.modules.get("torch")
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state() if torch else None) if restore else None
    py, npy, tch = batch_seeds(seed)
    random.seed(py)
    np.random.seed(npy)
    if torch is not None:
        torch.default_generator.manual_seed(tch)  # the CPU one only: CUDA's stay the program's
    try:
        yield
    finally:
        if saved is not None:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            if torch is not None and saved[2] is not None:
                torch.set_rng_state(saved[2])
