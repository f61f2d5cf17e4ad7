"""The batch transform hook: a user function ``transform(x, y) -> (x, y)`` run on every batch in the process that
read it, on numpy arrays (its contract, the same for every adapter: docs/api.md#transforms): ``x`` in place or
new arrays, ``(x, y)`` with as many integer labels as samples, ``x`` never kept.  numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Transform", "apply_transform"]

#: ``transform(x, y) -> (x, y)`` on numpy arrays (see the module docstring).
Transform = Callable[[np.ndarray, np.ndarray], tuple[Any, Any]]


def apply_transform(transform: Transform, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Run ``transform`` on the batch ``(x, y)`` read into buffer ``x``: ``(x', y', in_buffer)``, ``y'`` int64,
    ``in_buffer`` whether the samples are in ``x`` (changed in place, or copied there when of its shape and dtype).

    Raises:
        ValueError: the result is not a pair of arrays, the labels are not integers, or the sample and label
            counts differ.
    """
    out = transform(x, y)
    if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError(f"transform must return a pair (x, y), got {type(out).__name__}")
    tx, ty = np.asarray(out[0]), np.asarray(out[1])
    if ty.ndim != 1 or not (np.issubdtype(ty.dtype, np.integer) or ty.dtype == np.bool_):
        raise ValueError(f"transform must return 1-D integer labels, got {ty.dtype} of shape {ty.shape}")
    if tx.ndim == 0 or len(tx) != len(ty):
        raise ValueError(f"transform returned {len(tx) if tx.ndim else 0} samples and {len(ty)} labels")
    ty = ty.astype(np.int64, copy=False)
    if tx.shape != x.shape or tx.dtype != x.dtype:
        return tx, ty, False
    if not (tx.ctypes.data == x.ctypes.data and tx.strides == x.strides):
        np.copyto(x, tx)  # handles a result that overlaps the buffer
    return x, ty, True
