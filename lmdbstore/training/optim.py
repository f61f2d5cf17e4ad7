"""The optimizer :class:`~lmdbstore.config.TrainConfig` names, and ``torch.compile`` of the model it trains.

The one-cycle schedule drives the rate (and cycles AdamW's first beta or SGD's momentum).  ``torch.compile``
needs a C++ compiler on the CPU: without one ``compile=True`` is refused in one line before any step.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from lmdbstore.config import SGD_MOMENTUM, TrainConfig
from lmdbstore.errors import ModelError

__all__ = ["CPU_COMPILERS", "compiled", "make_optimizer"]

#: The C++ compilers inductor looks for on the CPU (``$CXX`` first when set).
CPU_COMPILERS = ("g++", "c++", "clang++")


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``model``'s parameters, at ``cfg.lr`` with ``cfg.weight_decay``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=SGD_MOMENTUM, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def compiled(net: nn.Module, ref: str) -> nn.Module:
    """``torch.compile(net)``; on a CPU model, refused at once when no C++ compiler is found.

    Raises:
        ModelError: ``torch.compile`` is unavailable, or the CPU toolchain it needs is missing (one line).
    """
    device = next((p.device for p in net.parameters()), torch.device("cpu"))
    if device.type == "cpu":
        names = ((os.environ["CXX"],) if os.environ.get("CXX") else ()) + CPU_COMPILERS
        if not any(shutil.which(n) for n in names):
            raise ModelError(
                f"compile=True needs a C++ compiler for torch.compile on the CPU; none found ({', '.join(names)})",
                path=ref,
                hint="install one (e.g. g++), or train without compile=True",
            )
    try:
        return torch.compile(net)  # type: ignore[return-value]
    except Exception as exc:  # an old torch, an unsupported Python
        raise ModelError(f"torch.compile is unavailable ({type(exc).__name__}: {exc})", path=ref) from exc
