"""Checks of what is about to be written (samples, labels), one place for the writer, ``ingest`` and
``write_parallel``'s workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import ValidationError, clip, preview
from lmdbstore.format.dtypes import label_dtype_for
from lmdbstore.format.meta import controlled_name

__all__ = ["check_samples", "label_ids"]


def label_ids(y: Any, n: int, classes: Sequence[str], *, path: str | Path | None = None) -> np.ndarray:
    """Turn labels (ids, class names, or one id/name for all ``n``) into class ids of the label dtype.

    Raises:
        ValidationError: wrong length, an unknown class name, a name holding a control character (numpy would
            drop a trailing NUL and match ``"a\\0"`` to ``"a"``), or an id outside ``0..len(classes)-1``.
    """
    n_classes = len(classes)
    _refuse_control_characters(y, path)
    if isinstance(y, (str, int, np.integer)):
        y = [y] * n
    arr = np.asarray(y)
    if arr.ndim != 1 or len(arr) != n:
        raise ValidationError(f"labels must be a 1-D sequence of {n} entries, got shape {arr.shape}", path=path)
    if arr.dtype.kind in "US":
        names = {name: i for i, name in enumerate(classes)}
        uniq, inverse = np.unique(arr.astype(str), return_inverse=True)
        unknown = [u for u in uniq.tolist() if u not in names]
        if unknown:
            raise ValidationError(
                f"unknown class label {clip(unknown[0])!r}; the classes are {preview(classes)}",
                path=path,
                hint="a store's classes are fixed when it is created: name them all with classes= then "
                "(or ingest every class in that first call)",
            )
        ids = np.array([names[u] for u in uniq.tolist()], np.int64)[inverse.reshape(-1)]
    elif arr.dtype.kind in "iu":
        if n and (arr.min() < 0 or arr.max() >= n_classes):  # on the labels as given: uint64 ids stay exact
            bad = int(arr[(arr < 0) | (arr >= n_classes)][0])
            raise ValidationError(f"label {bad} out of range 0..{n_classes - 1}", path=path)
        ids = arr.astype(np.int64)
    elif n == 0:
        ids = np.zeros(0, np.int64)
    else:
        raise ValidationError(f"labels must be integers or class names, got dtype {arr.dtype}", path=path)
    return ids.astype(label_dtype_for(n_classes))


def _refuse_control_characters(y: Any, path: str | Path | None) -> None:
    """Refuse class names given as Python strings (or bytes) that hold a control character, before numpy
    turns them into fixed-width strings and drops trailing NULs."""
    if isinstance(y, (str, bytes)):
        y = (y,)
    elif not (isinstance(y, (list, tuple)) and y and isinstance(y[0], (str, bytes))):
        return
    bad = controlled_name(set(y))
    if bad is not None:
        raise ValidationError(f"class label {bad[:60]!r} holds a control character", path=path)


def check_samples(
    x: Any,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    *,
    allow_nonfinite: bool = False,
    cast: bool = False,
    path: str | Path | None = None,
) -> np.ndarray:
    """Validate a batch of samples and return it as a C-contiguous little-endian array of ``dtype``.

    ``x`` may be one sample of ``shape`` or a batch ``(N, *shape)``.

    Raises:
        ValidationError: wrong shape, wrong dtype (unless ``cast`` and the kinds agree), or NaN/inf
            in a float batch while ``allow_nonfinite`` is off.  The message names the first bad sample.
    """
    arr = np.asarray(x)
    if arr.ndim == len(shape) and tuple(arr.shape) == tuple(shape):
        arr = arr[None]
    if arr.ndim != len(shape) + 1 or tuple(arr.shape[1:]) != tuple(shape):
        raise ValidationError(
            f"samples have shape {tuple(arr.shape)}, expected (N, {', '.join(map(str, shape))})", path=path
        )
    want = np.dtype(dtype)
    if arr.dtype.newbyteorder("<") != want.newbyteorder("<"):
        if not cast:
            raise ValidationError(
                f"samples have dtype {arr.dtype}, expected {want}", path=path, hint="convert them with cast=True"
            )
        if not np.can_cast(arr.dtype, want, casting="same_kind"):
            raise ValidationError(f"cannot cast dtype {arr.dtype} to {want}", path=path)
        if want.kind in "iu" and arr.size and not np.can_cast(arr.dtype, want, casting="safe"):
            lo, hi, info = int(arr.min()), int(arr.max()), np.iinfo(want)
            if lo < info.min or hi > info.max:  # a narrowing integer cast would wrap silently
                raise ValidationError(f"values {lo}..{hi} do not fit dtype {want}", path=path)
    arr = np.ascontiguousarray(arr, dtype=want)
    if want.kind == "f" and not allow_nonfinite and len(arr):
        finite = np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)
        if not finite.all():
            first = int(np.flatnonzero(~finite)[0])
            raise ValidationError(
                f"non-finite value (NaN or inf) in sample {first}", path=path, hint="allow_nonfinite=True accepts them"
            )
    return arr
