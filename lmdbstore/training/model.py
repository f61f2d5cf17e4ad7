"""The CNN ``lmdbstore train`` uses: small, fast on CPU, suited to single-channel inputs around 25x25.

Architecture (``width`` = w, default 16)::

    input (N, C, H, W)          C = 1 for 2-D samples
    conv3x3(C -> w)   + BN + ReLU, max-pool 2       25x25 -> 12x12
    conv3x3(w -> 2w)  + BN + ReLU, max-pool 2       12x12 -> 6x6
    conv3x3(2w -> 4w) + BN + ReLU
    global average pool, dropout 0.1, linear(4w -> classes)

Global pooling makes it accept any spatial size of at least 4x4.  2-D samples (H, W) are one-channel images, 3-D
samples (C, H, W) have C channels; 1-D samples are refused.  ``forward`` casts samples to the weights' dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from lmdbstore.config import MAX_WIDTH

__all__ = ["MIN_SPATIAL", "SmallCNN", "build_cnn", "input_channels", "state_shapes"]

#: Smallest height and width the two 2x max-pools can take.
MIN_SPATIAL = 4


def _block(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    """See the module docstring.  ``forward`` accepts any real dtype and casts to the weights' dtype."""

    def __init__(self, in_channels: int, n_classes: int, width: int = 16, dropout: float = 0.1):
        super().__init__()
        if in_channels < 1 or n_classes < 1 or width < 1:
            raise ValueError("in_channels, n_classes and width must be positive")
        if width > MAX_WIDTH:
            raise ValueError(f"width must be at most {MAX_WIDTH}, got {width}")
        w = width
        self.features = nn.Sequential(
            *_block(in_channels, w),
            nn.MaxPool2d(2),
            *_block(w, 2 * w),
            nn.MaxPool2d(2),
            *_block(2 * w, 4 * w),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(4 * w, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = next(self.parameters()).dtype
        if x.dtype != dtype:
            x = x.to(dtype)
        return self.head(self.features(x))


def input_channels(sample_shape: tuple[int, ...]) -> int:
    """The CNN's input channels for samples of ``sample_shape``: 1 for (H, W), C for (C, H, W).

    Raises:
        ValueError: shapes the CNN cannot take (not 2-D or 3-D, or smaller than 4x4), in one line.
    """
    shape = tuple(int(s) for s in sample_shape)
    if len(shape) == 2:
        channels, h, w = 1, *shape
    elif len(shape) == 3:
        channels, h, w = shape
    else:
        raise ValueError(
            f"the CNN takes 2-D (H, W) or 3-D (C, H, W) samples, got {len(shape)}-D samples of shape {shape}"
        )
    if h < MIN_SPATIAL or w < MIN_SPATIAL:
        raise ValueError(
            f"the CNN needs samples of at least {MIN_SPATIAL}x{MIN_SPATIAL} (two 2x pools), got shape {shape}"
        )
    return channels


def build_cnn(in_shape: tuple[int, ...], classes: int, width: int = 16) -> SmallCNN:
    """The built-in model factory (:data:`~lmdbstore.config.BUILTIN_MODEL`): the CNN for batches of
    ``(N, *in_shape)`` (``(C, H, W)`` as the loader feeds samples, or a store's sample shape), with ``width``.

    Raises:
        ValueError: shapes the CNN cannot take, or a ``width`` out of range.
    """
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width must be an integer in 1..{MAX_WIDTH}, got {width!r}")
    return SmallCNN(input_channels(tuple(in_shape)), classes, width)


def state_shapes(sample_shape: tuple[int, ...], n_classes: int, width: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every entry of :func:`build_cnn`'s ``state_dict``, without allocating any of it
    (the model is built on PyTorch's ``meta`` device): what a checkpoint's weights must look like.

    Raises:
        ValueError: as :func:`build_cnn`.
    """
    with torch.device("meta"):
        model = build_cnn(sample_shape, n_classes, width)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
