"""The checks of :mod:`lmdbstore.config`'s dataclasses that are more than a line: integers, per-store
``weights`` and the model fields of ``TrainConfig`` (kept here so that config.py stays the table of fields and defaults)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_int", "check_model_args", "check_model_fields", "check_weights"]

#: Most ``model_args`` a factory gets (they go into checkpoints, as JSON).
MAX_MODEL_ARGS = 64
#: Longest string value of one of the ``model_args``.
MAX_MODEL_ARG_CHARS = 1000
#: Optimizers ``TrainConfig`` can name.
OPTIMIZERS = ("adamw", "sgd")
#: The built-in CNN's factory (``module:function``), the default ``TrainConfig.model``.
BUILTIN_MODEL = "lmdbstore.training.model:build_cnn"


def check_int(name: str, value: Any, least: int | None) -> None:
    """Refuse a ``value`` that is not an int (``bool`` included) or is below ``least``.

    Raises:
        ValueError: naming ``name``.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be {'positive' if least == 1 else f'>= {least}'}, got {value}")


def check_weights(weights: Any, shuffle: str | None, balanced: bool) -> None:
    """Refuse per-store ``weights`` that are not finite non-negative numbers, not all 0 (any such weights are
    normalized without overflow: :func:`lmdbstore.loader.mixing.normalized_weights`), or that come with
    an order that cannot keep their shares exact.

    Raises:
        ValueError: naming the field.
    """
    if weights is None:
        return
    try:
        w = [float(v) for v in weights]
    except (TypeError, ValueError):
        raise ValueError(f"weights must be a list of numbers, got {weights!r}") from None
    if not w or any(not math.isfinite(v) or v < 0 for v in w) or not max(w) > 0:  # max: a sum may overflow
        raise ValueError(f"weights must be finite non-negative numbers, not all 0, got {weights!r}")
    if balanced:
        raise ValueError("weights and balanced exclude each other (balanced draws by class, weights by store)")
    if shuffle not in (None, "auto", "random"):
        raise ValueError(
            f"weights draw each store's share at random: shuffle must be 'random' or 'auto', got {shuffle!r}"
        )


def check_model_args(args: Any) -> tuple[tuple[str, Any], ...]:
    """``model_args`` (a mapping or ``(name, value)`` pairs) as sorted pairs of identifiers and JSON scalars.

    Raises:
        ValueError: naming ``model_args``: not a mapping, a name that is no identifier, a value that is not a
            finite JSON scalar, too many or too long.
    """
    pairs = list(args.items()) if isinstance(args, dict) else list(args or ())
    if len(pairs) > MAX_MODEL_ARGS:
        raise ValueError(f"model_args holds {len(pairs)} arguments; at most {MAX_MODEL_ARGS}")
    out: dict[str, Any] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"model_args must be a mapping of names to values, got {args!r}")
        name, value = pair
        if not isinstance(name, str) or not name.isidentifier() or len(name) > 100:
            raise ValueError(f"model_args names must be Python identifiers, got {name!r}")
        ok = value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))
        if not ok:
            raise ValueError(f"model_args[{name!r}] must be a string, number, bool or None, got {value!r}")
        if isinstance(value, str) and len(value) > MAX_MODEL_ARG_CHARS:
            raise ValueError(f"model_args[{name!r}] is longer than {MAX_MODEL_ARG_CHARS} characters")
        out[name] = value
    return tuple(sorted(out.items()))


def check_model_fields(cfg: Any, default_width: int) -> tuple[tuple[str, Any], ...]:
    """Check ``TrainConfig``'s model fields; return its ``model_args`` as sorted pairs.

    Raises:
        ValueError: naming the field.
    """
    if not isinstance(cfg.model, str) or ":" not in cfg.model or not cfg.model.rpartition(":")[2]:
        raise ValueError(f"model must be 'module:function' or 'path/to/file.py:function', got {cfg.model!r}")
    args = check_model_args(cfg.model_args)
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(map(repr, OPTIMIZERS))}, got {cfg.optimizer!r}")
    if not 0.0 <= cfg.label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {cfg.label_smoothing}")
    if cfg.model != BUILTIN_MODEL and cfg.width != default_width:
        raise ValueError("width is the built-in CNN's argument; give a model's own arguments in model_args")
    if "width" in dict(args) and cfg.width != default_width:
        raise ValueError("width is given twice: as width and in model_args")
    return args
