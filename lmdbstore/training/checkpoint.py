"""Training checkpoints: written atomically, loaded with ``torch.load(weights_only=True)`` (no pickle
code runs), and checked before anything is built from them.

A checkpoint is a dict of tensors and plain values (format ``CHECKPOINT_FORMAT``): the model's state dict, class
names, sample shape, input channels and width, the model's factory and its arguments (``model_factory``,
``model_args`` as JSON; a checkpoint without one of them is refused), plus what resuming needs (optimizer state,
epoch, history).  What it claims is bounded (width, classes, dimensions) and its weights must have exactly the
shapes of the model it describes, so a hostile file cannot make :func:`load_checkpoint` allocate gigabytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmdbstore.config import BUILTIN_MODEL, MAX_WIDTH
from lmdbstore.configcheck import check_model_args
from lmdbstore.errors import LmdbStoreError, ModelError, ValidationError, preview
from lmdbstore.format.limits import MAX_CLASSES, MAX_DIM
from lmdbstore.training.factory import ModelRef, build_from, feed_shape, model_ref
from lmdbstore.training.model import input_channels, state_shapes
from lmdbstore.util.atomic import atomic_paths

__all__ = [
    "CHECKPOINT_FORMAT",
    "RESUME_KEYS",
    "atomic_save",
    "check_checkpoint",
    "check_model_spec",
    "checkpoint_model",
    "first_line",
    "is_int",
    "load_checkpoint",
    "load_weights",
    "model_channels",
    "model_from_checkpoint",
    "model_name",
]

CHECKPOINT_FORMAT = 1
_CHECKPOINT_KEYS = {"model", "classes", "sample_shape", "in_channels", "width", "model_factory", "model_args"}
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
    channels = ckpt["in_channels"]
    if not is_int(channels) or not 1 <= channels <= MAX_DIM:
        raise bad(f"in_channels {channels!r} is not in 1..{MAX_DIM}")
    try:
        name, _ = checkpoint_model(ckpt)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if name != BUILTIN_MODEL:  # the user's model: its weights are checked against the model its factory builds
        if not isinstance(ckpt["model"], dict) or not all(isinstance(t, torch.Tensor) for t in ckpt["model"].values()):
            raise bad("model must be a state dict of tensors")
        return
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


def model_name(ref: ModelRef) -> str:
    """How a checkpoint names the model of factory ``ref``: :data:`BUILTIN_MODEL`, or the factory's identity."""
    return BUILTIN_MODEL if ref.builtin else ref.identity


def checkpoint_model(ckpt: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The model a checkpoint records: its name (:func:`model_name`) and its factory's arguments.

    Raises:
        ValueError: ``model_factory`` or ``model_args`` malformed.
    """
    name, raw = ckpt["model_factory"], ckpt["model_args"]
    if not isinstance(name, str) or not 3 <= len(name) <= 300 or ":" not in name:
        raise ValueError("model_factory must be a factory's name")
    try:
        args = json.loads(raw) if isinstance(raw, str) and len(raw) < 1 << 20 else None
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise ValueError("model_args must be a JSON object")
    if name == BUILTIN_MODEL:  # its one argument is the checkpoint's width (checked against its weights)
        return name, {"width": ckpt["width"]}
    return name, dict(check_model_args(args))


def check_model_spec(ckpt: dict[str, Any], name: str, kwargs: dict[str, Any], ckpt_path: Path) -> None:
    """Refuse a checkpoint of another model than factory ``name`` with arguments ``kwargs``.

    Raises:
        ModelError: another factory, or other arguments (both named, in one line).
    """
    have, args = checkpoint_model(ckpt)
    if have != name:
        raise ModelError(
            f"checkpoint holds a model of factory {have}, not {name}",
            path=ckpt_path,
            hint="give the checkpoint's factory as model=, with the same model_args=",
        )
    if args != kwargs:
        raise ModelError(
            f"checkpoint's model was built with model_args {json.dumps(args, sort_keys=True)}, "
            f"not {json.dumps(kwargs, sort_keys=True)}",
            path=ckpt_path,
            hint="give the checkpoint's model_args=",
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
    trained_c = int(ckpt["in_channels"])
    channels = feed_shape(shape)[0]
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


def model_from_checkpoint(
    ckpt: dict[str, Any], ckpt_path: Path, model: str | None = None, model_args: dict[str, Any] | None = None
) -> nn.Module:
    """The model a checked checkpoint describes, with its weights: the built-in CNN from the checkpoint alone, a
    user's model only from the factory the caller names as ``model`` (a checkpoint never chooses code to import),
    with the checkpoint's arguments (``model_args``, when given, must be them).

    Raises:
        ModelError: a user model's checkpoint without ``model``, another factory or other arguments than the
            checkpoint's, or the factory fails.
        LmdbStoreError: weights that do not fit the model.
    """
    name, args = checkpoint_model(ckpt)
    ref = model_ref(model if model is not None else BUILTIN_MODEL)
    if model is None and name != BUILTIN_MODEL:
        raise ModelError(
            f"checkpoint holds a model of factory {name} (model_args {json.dumps(args, sort_keys=True)}); "
            "its code is not loaded on a checkpoint's word",
            path=ckpt_path,
            hint="name the factory with model=",
        )
    check_model_spec(
        ckpt, model_name(ref), args if model_args is None else dict(check_model_args(model_args)), ckpt_path
    )
    net = build_from(ref, feed_shape(tuple(ckpt["sample_shape"])), len(ckpt["classes"]), args)
    load_weights(net, ckpt, ckpt_path)
    return net
