"""What a reader of one store and a set of stores both derive from their metadata: length, sample shape, dtype
and class names (one definition for :class:`~lmdbstore.store.reader.StoreReader` and
:class:`~lmdbstore.store.multi.StoreSet`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lmdbstore.format.meta import StoreMeta

__all__ = ["MetaView"]


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
