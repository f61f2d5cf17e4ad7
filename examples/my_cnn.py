"""A model of your own for `lmdbstore train --model examples/my_cnn.py:build` (see the README)."""

from torch import nn


def build(in_shape, classes, width=32):
    """in_shape: one sample as fed, (C, H, W); classes: how many; width: from --model-arg width=N."""
    c = in_shape[0]
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes),
    )  # fmt: skip
