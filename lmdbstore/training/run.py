"""What one training run works with, set up once by :func:`~lmdbstore.training.trainer.train` and handed
to the epoch loop (:mod:`~lmdbstore.training.loop`) and the checkpoints (:mod:`~lmdbstore.training.saving`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.training.data import TrainData
from lmdbstore.training.distributed import DistInfo
from lmdbstore.training.metrics import Log
from lmdbstore.training.tboard import ScalarLog

__all__ = ["TrainRun"]


@dataclass
class TrainRun:
    """Everything the epoch loop works with.

    ``model`` is the bare model (its state dict is what checkpoints hold); ``net`` is what steps run through
    (``model`` wrapped in DistributedDataParallel under torchrun, else ``model`` itself).
    """

    cfg: TrainConfig
    lcfg: LoaderConfig
    info: DistInfo
    device: torch.device
    data: TrainData
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    steps: int  # optimizer steps per epoch
    out: Path | None  # the output directory (``None``: nothing is written)
    progress: bool | None  # a progress bar per epoch on rank 0 (``None``: when stderr is a terminal)
    say: Log  # rank 0's lines (a no-op on the other ranks)
    sampler: Any = None  # the training sampler
    tb: ScalarLog | None = None  # TensorBoard scalars (rank 0, when tensorboard is installed)
    train_loader: Any = None  # the training loader (its state -- the batches it delivered -- goes into checkpoints)
    stop: Any = None  # ``() -> bool``, asked after every step: stop there (checkpoint written), or ``None``
    val_loader: Any = None  # the validation loader (``None``: no validation split)
    splits: str = "[]"  # the records of the run's split, as JSON (:class:`~lmdbstore.loader.choose.SplitRecord`)

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's files (rank 0 with an output directory)."""
        return self.out is not None and self.info.is_main
