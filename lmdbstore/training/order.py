"""The epoch order a training run draws, fixed once for the whole run (docs/design.md#resuming-inside-an-epoch).

``shuffle="auto"``'s choice and the window's size depend on the memory available, so rank 0 makes them
(:func:`agree_order`), every rank takes its answer, every checkpoint records them and a resumed run takes them
from there (:func:`recorded_order`); what the user names (``shuffle``, ``window_mb``) still wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lmdbstore.config import LoaderConfig
from lmdbstore.loader.choose import pick_shuffle
from lmdbstore.loader.window import bound_window_bytes, default_window_bytes
from lmdbstore.training.distributed import DistInfo
from lmdbstore.training.metrics import Log

__all__ = ["Order", "agree_order", "order_of", "recorded_order"]

#: The orders that can be pinned, by the code :func:`agree_order` sends between ranks (0: nothing to pin).
SHUFFLES = (None, "none", "random", "block", "window")


@dataclass(frozen=True)
class Order:
    """A run's order: ``shuffle`` (``None`` for class-balanced or weighted sampling, which ``auto`` does not
    choose) and, for ``window``, the window's size in sample bytes."""

    shuffle: str | None = None
    window_bytes: int | None = None

    def to_json(self) -> str:
        return json.dumps({"shuffle": self.shuffle, "window_bytes": self.window_bytes})

    @classmethod
    def from_json(cls, text: str) -> Order:
        """Raises: ValueError: not an order this module writes."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("shuffle") not in SHUFFLES:
            raise ValueError(f"not a training order: {text[:80]!r}")
        w = d.get("window_bytes")
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"window_bytes {w!r} is not a positive integer")
        return cls(d["shuffle"], w)


def order_of(sampler: Any) -> Order:
    """The order ``sampler`` draws, looking through the trainer's wrappers (equal steps, set grouping)."""
    while not hasattr(sampler, "shuffle") and hasattr(sampler, "inner"):
        sampler = sampler.inner
    shuffle = getattr(sampler, "shuffle", None)
    if shuffle not in SHUFFLES:
        return Order()
    return Order(shuffle, getattr(sampler, "window_bytes", None) if shuffle == "window" else None)


def recorded_order(ckpt: dict[str, Any] | None) -> Order | None:
    """The order a resumed run's checkpoint recorded; ``None`` for a fresh run (no checkpoint), or a checkpoint
    without one (earlier versions) or with one that does not parse (the sampler's own state check still
    applies)."""
    text = ckpt.get("order") if ckpt is not None else None
    try:
        return Order.from_json(text) if isinstance(text, str) else None
    except ValueError:
        return None


def agree_order(
    lcfg: LoaderConfig,
    store: Any,
    data_bytes: int,
    info: DistInfo,
    device: torch.device,
    say: Log,
    recorded: Order | None = None,
) -> Order:
    """The run's order: what ``lcfg`` names, else what ``recorded`` (a resumed run's checkpoint) says, else
    ``auto``'s choice for ``store`` and an eighth of available memory for a window; under ``torchrun`` rank 0's
    answer for every rank.  ``data_bytes``: the training split's sample bytes (a window never holds more of
    the data than the machine can give: :func:`~lmdbstore.loader.window.bound_window_bytes`)."""
    order = Order()
    if info.is_main and not lcfg.balanced and lcfg.weights is None:
        order = _decide(lcfg, store, data_bytes, say, recorded)
    if not info.active:
        return order
    msg = torch.tensor([SHUFFLES.index(order.shuffle), order.window_bytes or 0], dtype=torch.int64, device=device)
    dist.broadcast(msg, src=0)
    code, window = (int(v) for v in msg.tolist())
    return Order(SHUFFLES[code], window or None)


def _decide(lcfg: LoaderConfig, store: Any, data_bytes: int, say: Log, recorded: Order | None) -> Order:
    if lcfg.order != "auto":
        shuffle = lcfg.order
    elif recorded is not None and recorded.shuffle is not None:
        shuffle = recorded.shuffle
        say(f"shuffle: {shuffle} (the order the checkpoint's run chose)")
    else:
        shuffle = pick_shuffle(lcfg, store, say)
    if shuffle != "window":
        return Order(shuffle)
    if lcfg.window_mb is not None:
        return Order(shuffle, bound_window_bytes(lcfg.window_mb << 20, data_bytes, "window_mb"))
    if recorded is not None and recorded.window_bytes is not None:
        return Order(shuffle, recorded.window_bytes)
    return Order(shuffle, default_window_bytes())
