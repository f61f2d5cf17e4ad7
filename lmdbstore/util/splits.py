"""The checks of a validation split's parameters, shared by the configurations (:mod:`lmdbstore.config`), the split
itself (:func:`lmdbstore.loader.samplers.stratified_split`) and the command line: one rule each."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_val_fraction", "check_val_limit"]


def check_val_fraction(value: Any, name: str = "val_fraction") -> None:
    """A validation split given as a share of every class (``0 <= value < 1``) or as a count of samples (a whole
    number ``>= 2``, e.g. ``20000``: held out in proportion to the classes; ``1`` is refused as ambiguous).

    Raises:
        ValueError: anything else (naming ``name``).
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value >= 1 and (value != int(value) or value < 2)):
        raise ValueError(f"{name} must be a share in [0, 1) or a whole number of samples (2 or more), got {value!r}")


def check_val_limit(value: Any, every: int | None = None) -> None:
    """How much of the validation split one validation reads: ``None`` (all), a number of batches (an int
    ``>= 1``, per process) or a share of the split (a float in ``(0, 1]``); and how often it runs inside epochs
    (``every``: ``None`` or a positive number of steps).

    Raises:
        ValueError: anything else (naming ``val_limit`` or ``val_every``).
    """
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"val_every must be a positive number of steps, got {every!r}")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"val_limit must be a number of batches or a share in (0, 1], got {value!r}")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"val_limit must be at least 1 batch, got {value}")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"val_limit as a share must be in (0, 1], got {value}")
