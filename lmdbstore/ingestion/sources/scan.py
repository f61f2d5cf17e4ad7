"""Validating sources before anything is written (:func:`scan_source`), and inferring a new store's classes from
them (:func:`infer_classes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmdbstore.errors import ValidationError, preview
from lmdbstore.format.limits import MAX_CLASSES
from lmdbstore.ingestion.sources.base import Source
from lmdbstore.store.validation import check_samples, label_ids


def _first_nonfinite(x: np.ndarray) -> int | None:
    """Index of the first sample of ``x`` holding a NaN or inf (None if all are finite or not floats)."""
    if x.dtype.kind != "f" or not len(x):
        return None
    ok = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
    return None if ok.all() else int(np.flatnonzero(~ok)[0])


def _first_bad_label(y: np.ndarray, classes: Sequence[str]) -> int | None:
    """Index of the first label that is not one of ``classes`` (an unknown name or an id out of range)."""
    if y.dtype.kind in "US":
        bad = ~np.isin(y.astype(str), np.asarray(list(classes), dtype=str))
    elif y.dtype.kind in "iu":
        bad = (y < 0) | (y >= len(classes))
    else:
        return 0 if len(y) else None
    return int(np.flatnonzero(bad)[0]) if bad.any() else None


def scan_source(
    src: Source,
    *,
    shape: Sequence[int],
    dtype: Any,
    classes: Sequence[str],
    allow_nonfinite: bool = False,
    cast: bool = False,
    batch: int = 65536,
    progress: Callable[[int], None] | None = None,
    start: int = 0,
    stop: int | None = None,
) -> None:
    """Validate every sample and label of ``src`` (from ``start``, to the end of the batch reaching ``stop``)
    against a store, writing nothing, through the writer's own checks (what passes here, ``StoreWriter.append``
    accepts); ``progress(n)`` after each batch with the samples it checked.

    Raises:
        ValidationError: wrong shape or dtype, NaN/inf (unless ``allow_nonfinite``), an unknown class
            name or an id out of range; ``path`` is the file and ``key`` the first bad sample's index
            within that file (``None`` for shape/dtype, which concern the whole file).
        SourceError: the file cannot be read.
    """
    shape_t = tuple(int(s) for s in shape)
    want = np.dtype(dtype)
    pos = start
    for x, y in src.iter_batches(batch, start):
        try:
            check_samples(x, shape_t, want, allow_nonfinite=allow_nonfinite, cast=cast)
        except ValidationError as exc:
            bad = _first_nonfinite(x) if not allow_nonfinite and "non-finite" in exc.message else None
            if bad is None:
                raise ValidationError(exc.message, path=src.locate(pos)[0], hint=exc.hint) from exc
            file, idx = src.locate(pos + bad)
            raise ValidationError(
                "sample has a non-finite value (NaN or inf)", path=file, key=idx, hint=exc.hint
            ) from exc
        try:
            label_ids(y, len(x), classes)
        except ValidationError as exc:
            bad = _first_bad_label(np.asarray(y), classes)
            file, idx = src.locate(pos + (bad or 0))
            raise ValidationError(exc.message, path=file, key=idx if bad is not None else None, hint=exc.hint) from exc
        pos += len(x)
        if progress is not None:
            progress(len(x))
        if stop is not None and pos >= stop:
            return


def infer_classes(sources: Sequence[Source], *, batch: int = 1 << 20) -> list[str]:
    """Class list for a new store when none is given.

    Rule: the sorted union of every class name the sources imply -- ``label=`` names, ``class_names``
    arrays, directory subdirectory names, and (with one pass over the labels only, for sources that
    have none of those) class-name labels found in the files.  If no source implies any name, the
    labels are integer ids and the classes are ``["0", ..., str(max id)]``.  Integer labels next to
    names index the sorted names, so their maximum must fit.

    Raises:
        ValueError: no sources.
        ValidationError: a negative integer label, or integer labels beyond the inferred names.
    """
    if not sources:
        raise ValueError("sources must not be empty")
    names: set[str] = set()
    max_id = -1  # the largest integer label, and where it is
    max_at: tuple[Path, int | None] = (sources[0].path, None)

    def too_many(src: Source, pos: int) -> ValidationError:
        return ValidationError(
            f"the sources name more than the {MAX_CLASSES} classes a store can have", path=src.locate(pos)[0]
        )

    for src in sources:
        implied = src.class_names()
        if implied is not None:
            names.update(implied)
            if len(names) > MAX_CLASSES:
                raise too_many(src, 0)
            continue
        if isinstance(src.label, int):
            if src.label > max_id:
                max_id, max_at = src.label, (src.path, None)
                _check_id_bound(max_id, *max_at)
            continue
        pos = 0
        for y in src.iter_labels(batch):
            if y.dtype.kind in "US":
                names.update(np.unique(y.astype(str)).tolist())
                if len(names) > MAX_CLASSES:
                    raise too_many(src, pos)
            elif len(y):
                lo = int(y.min())
                if lo < 0:
                    file, idx = src.locate(pos + int(np.argmin(y)))
                    raise ValidationError(f"label {lo} is negative", path=file, key=idx)
                hi = int(y.max())
                if hi > max_id:  # checked at once: nothing below is ever sized by a label's value
                    max_id, max_at = hi, src.locate(pos + int(np.argmax(y)))
                    _check_id_bound(max_id, *max_at)
            pos += len(y)
    if not names:
        return [str(i) for i in range(max_id + 1)]
    result = sorted(names)
    if max_id >= len(result):
        raise ValidationError(
            f"integer label {max_id} is beyond the {len(result)} class names inferred ({preview(result)})",
            path=max_at[0],
            key=max_at[1],
            hint="give the classes explicitly with classes=",
        )
    return result


def _check_id_bound(label: int, path: Path, key: int | None) -> None:
    """Refuse an integer label no store can hold (ids index at most ``MAX_CLASSES`` classes)."""
    if label >= MAX_CLASSES:
        raise ValidationError(
            f"label {label} is beyond the largest class id a store can have ({MAX_CLASSES - 1})",
            path=path,
            key=key,
            hint="class ids must be 0..number of classes - 1",
        )
