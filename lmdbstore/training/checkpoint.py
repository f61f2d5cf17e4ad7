"""Training checkpoints: written atomically, loaded with ``torch.load(weights_only=True)`` (no pickle
code runs), and checked before anything is built from them.

A checkpoint is a dict of tensors and plain values (format ``CHECKPOINT_FORMAT``): the model's state dict,
class names, sample shape, input channels and width, plus what resuming needs (optimizer state, epoch,
history).  What it claims is bounded (width, classes, dimensions) and its weights must have exactly the
shapes of the model it describes, so a hostile file cannot make :func:`load_checkpoint` allocate gigabytes;
every failure is one :class:`~lmdbstore.errors.LmdbStoreError` line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmdbstore.config import MAX_WIDTH
from lmdbstore.errors import LmdbStoreError, ValidationError, preview
from lmdbstore.format.limits import MAX_CLASSES, MAX_DIM
from lmdbstore.training.model import build_model, input_channels, state_shapes
from lmdbstore.util.atomic import atomic_paths

__all__ = [
    "CHECKPOINT_FORMAT",
    "RESUME_KEYS",
    "atomic_save",
    "check_checkpoint",
    "first_line",
    "is_int",
    "load_checkpoint",
    "load_weights",
    "model_channels",
    "model_from_checkpoint",
]

CHECKPOINT_FORMAT = 1
_CHECKPOINT_KEYS = {"model", "classes", "sample_shape", "width"}
RESUME_KEYS = {"optimizer", "epoch", "history"}  # what resuming needs beyond the model


def atomic_save(obj: dict[str, Any], path: Path) -> None:
    """Write a checkpoint next to ``path`` and rename it into place: a crash never leaves half a file."""
    with atomic_paths([path]) as (tmp,):
        torch.save(obj, tmp)


def load_checkpoint(path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`train` with ``torch.load(weights_only=True)`` (no pickle code).

    Raises:
        LmdbStoreError: missing file, not a checkpoint, or one of another format.
    """
    p = Path(path)
    if not p.is_file():
        raise LmdbStoreError("no such checkpoint", path=p)
    try:
        ckpt = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged or hostile file
        raise LmdbStoreError(f"cannot load checkpoint ({type(exc).__name__}: {exc})".splitlines()[0], path=p) from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise LmdbStoreError("not an lmdbstore checkpoint", path=p)
    missing = sorted(_CHECKPOINT_KEYS - ckpt.keys())
    if missing:
        raise LmdbStoreError(f"not an lmdbstore checkpoint (no {', '.join(missing)})", path=p)
    _check_claims(ckpt, p)
    return ckpt


def is_int(v: object) -> bool:
    """A real int (``bool`` is not one here)."""
    return isinstance(v, int) and not isinstance(v, bool)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none: the cause a one-line
    checkpoint error quotes."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_claims(ckpt: dict[str, Any], p: Path) -> None:
    """Bound the model a checkpoint describes, and check that its weights are that model's, before anything
    is built from it: a checkpoint claiming a huge ``width`` would otherwise allocate gigabytes."""

    def bad(msg: str) -> LmdbStoreError:
        return LmdbStoreError(f"malformed checkpoint: {msg}", path=p)

    classes, shape, width = ckpt["classes"], ckpt["sample_shape"], ckpt["width"]
    if (
        not isinstance(classes, list)
        or not 1 <= len(classes) <= MAX_CLASSES
        or not all(isinstance(c, str) for c in classes)
    ):
        raise bad(f"classes must be a list of 1..{MAX_CLASSES} names")
    if not isinstance(shape, (list, tuple)) or not all(is_int(d) and 1 <= d <= MAX_DIM for d in shape):
        raise bad(f"sample_shape must be a list of dimensions in 1..{MAX_DIM}")
    if not is_int(width) or not 1 <= width <= MAX_WIDTH:
        raise bad(f"width {width!r} is not in 1..{MAX_WIDTH}")
    channels = ckpt.get("in_channels", 1)
    if not is_int(channels) or not 1 <= channels <= MAX_DIM:
        raise bad(f"in_channels {channels!r} is not in 1..{MAX_DIM}")
    try:
        want = state_shapes(tuple(shape), len(classes), width)
    except ValueError as exc:  # a sample shape the CNN cannot take
        raise bad(str(exc)) from None
    weights = ckpt["model"]
    if not isinstance(weights, dict):
        raise bad("model must be a state dict")
    for name, shp in want.items():
        got = weights.get(name)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != shp:
            have = (
                "missing"
                if got is None
                else f"of shape {tuple(got.shape)}"
                if isinstance(got, torch.Tensor)
                else "not a tensor"
            )
            raise LmdbStoreError(
                f"checkpoint weights do not fit the model it describes: {name} is {have}, "
                f"width {width} and {len(classes)} classes need {shp}",
                path=p,
            )


def model_channels(shape: tuple[int, ...], path: Path) -> int:
    """The CNN's input channels for the store's samples, or a one-line error for shapes it cannot take."""
    try:
        return input_channels(shape)
    except ValueError as exc:
        raise ValidationError(
            str(exc), path=path, hint="the CNN trains on (H, W) or (C, H, W) samples of at least 4x4"
        ) from exc


def check_checkpoint(ckpt: dict[str, Any], classes: list[str], shape: tuple[int, ...], ckpt_path: Path) -> None:
    """Refuse a checkpoint trained on other classes, another channel count or another sample shape."""
    trained = tuple(int(s) for s in ckpt["sample_shape"])
    # checkpoints from before in_channels was stored: the channels follow from the shape
    trained_c = int(ckpt["in_channels"]) if "in_channels" in ckpt else input_channels(trained)
    channels = input_channels(shape)
    if trained_c != channels:
        raise LmdbStoreError(
            f"checkpoint was trained on {trained_c}-channel samples of shape {trained}, "
            f"the store has {channels}-channel samples of shape {shape}",
            path=ckpt_path,
            hint="use a checkpoint trained on a store with the same sample shape",
        )
    if ckpt["classes"] != classes or trained != shape:
        raise LmdbStoreError(
            f"checkpoint was trained on classes [{preview(ckpt['classes'])}] and shape {trained}, "
            f"the store has [{preview(classes)}] and {shape}",
            path=ckpt_path,
        )


def load_weights(model: nn.Module, ckpt: dict[str, Any], ckpt_path: Path) -> None:
    """Load the checkpoint's weights into ``model``; weights that do not fit are a one-line error."""
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, KeyError, TypeError) as exc:  # a checkpoint whose weights do not fit this model
        raise LmdbStoreError(f"checkpoint weights do not fit the model ({first_line(exc)})", path=ckpt_path) from exc


def model_from_checkpoint(ckpt: dict[str, Any], ckpt_path: Path) -> nn.Module:
    """The model a checked checkpoint describes, with its weights."""
    model = build_model(tuple(ckpt["sample_shape"]), len(ckpt["classes"]), int(ckpt["width"]))
    load_weights(model, ckpt, ckpt_path)
    return model
