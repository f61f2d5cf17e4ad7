"""A batch's and the model's way onto the device, shared by training and evaluation.

A batch crosses to the device in the store's own dtype and is converted there, straight into channels-last for
images.  Mixed precision (bfloat16 autocast) applies on CUDA only.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

__all__ = ["autocast", "place_model", "to_device"]


def autocast(device: torch.device, amp: bool) -> AbstractContextManager[Any]:
    """bfloat16 autocast when ``amp`` and ``device`` is CUDA; a no-op context otherwise."""
    if amp and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def to_device(
    x: torch.Tensor, y: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a batch to ``device``, then convert ``x`` to the model's ``dtype`` (default float32) there
    (channels-last for images): the copy moves the store's own bytes, and a float32 batch is not converted
    at all (on the CPU it is the same tensor)."""
    nb = device.type == "cuda"
    x = x.to(device, non_blocking=nb)
    y = y.to(device, non_blocking=nb)
    fmt = torch.channels_last if x.dim() == 4 else torch.preserve_format
    if x.dtype != dtype:
        x = x.to(dtype, memory_format=fmt)  # one conversion, straight into the layout the model wants
    elif x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``; on the CPU also in channels-last, the layout :func:`to_device` gives images."""
    model = model.to(device)
    if device.type == "cpu":
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model
