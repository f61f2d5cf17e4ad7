"""What a reader of one store and a set of stores both derive from their metadata: length, sample shape, dtype
and class names (one definition for :class:`~lmdbstore.store.reader.StoreReader` and
:class:`~lmdbstore.store.multi.StoreSet`), and the one check of the sample indices both take."""

from __future__ import annotations

from typing import Any

import numpy as np

from lmdbstore.format.meta import StoreMeta

__all__ = ["MetaView", "sample_indices"]


def sample_indices(indices: Any, *, flat: bool = True) -> np.ndarray:
    """``indices`` as int64 sample numbers (flattened unless ``flat=False``); nothing is cast silently.

    Raises:
        ValueError: a boolean mask (``np.flatnonzero(mask)`` gives its indices) or indices that are not
            integers (``1.7`` would read sample 1).
    """
    arr = np.asarray(indices)
    if arr.dtype.kind not in "iu":
        if arr.dtype == np.bool_:
            raise ValueError("indices: a boolean mask is not a list of sample indices (use np.flatnonzero(mask))")
        if arr.size:
            raise ValueError(f"indices must be integer sample indices, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    return arr.reshape(-1) if flat else arr


class MetaView:
    """``len()``, ``shape``, ``dtype`` and ``classes`` read from ``self.meta``, which a subclass provides."""

    @property
    def meta(self) -> StoreMeta:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.meta.count

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.meta.np_dtype

    @property
    def classes(self) -> list[str]:
        return list(self.meta.classes)
