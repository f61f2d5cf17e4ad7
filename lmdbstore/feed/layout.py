"""Where a batch's channel axis goes: ``"first"`` (PyTorch: ``(N, 1, H, W)`` for (H, W) samples, (C, H, W) as
stored), ``"last"`` (Keras, TensorFlow: ``(N, H, W, 1)``, (C, H, W) moved to ``(N, H, W, C)`` on the way) or
``"stored"`` (``(N, *shape)``).  numpy only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from lmdbstore.store.readers import Reader

__all__ = ["CHANNELS", "BatchLayout", "Channels"]

#: Where a batch's channel axis goes (see the module docstring).
Channels = Literal["first", "last", "stored"]
#: The layouts, for messages and checks.
CHANNELS: tuple[Channels, ...] = ("first", "last", "stored")


@dataclass(frozen=True)
class BatchLayout:
    """The layout in a batch of a store's samples of ``shape`` and ``dtype`` (a name): ``channels`` ``"first"``,
    ``"last"`` or ``"stored"`` (see the module docstring)."""

    shape: tuple[int, ...]
    dtype: str
    channels: Channels = "last"

    def __post_init__(self) -> None:
        if self.channels not in CHANNELS:
            raise ValueError(f"channels must be one of {', '.join(CHANNELS)}, got {self.channels!r}")

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one sample in a batch."""
        if self.channels == "first" and len(self.shape) < 3:
            return (1, *self.shape)
        if self.channels == "last" and len(self.shape) == 2:
            return (*self.shape, 1)
        if self.channels == "last" and len(self.shape) == 3:
            c, h, w = self.shape
            return (h, w, c)
        return self.shape

    @property
    def item_bytes(self) -> int:
        """Bytes of one sample."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def moves(self) -> bool:
        """Whether samples change place on the way (channels moved last): no straight read into a batch."""
        return self.channels == "last" and len(self.shape) == 3

    def read(self, reader: Reader, idx: np.ndarray, out: np.ndarray) -> None:
        """Read samples ``idx`` into ``out`` (``(len(idx), *item_shape)``)."""
        if self.moves:
            np.copyto(out, reader.read_batch(idx).transpose(0, 2, 3, 1))
        else:
            reader.read_batch(idx, out=out.reshape(len(idx), *self.shape))
