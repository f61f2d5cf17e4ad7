"""The generators a batch's user code sees (``random``, numpy's global one, torch's CPU one where imported),
seeded from the run's seed, the epoch and the batch's number: the same on a rerun, after a resume and with any
number of readers.  In the consumer's own process they are put back after the batch (``restore=True``).
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
