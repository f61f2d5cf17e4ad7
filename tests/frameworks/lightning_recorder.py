"""The LightningModule of lightning_ddp.py and lightning_resume.py: a linear model over make_loader that records
the sample numbers of every batch it trains on, per epoch (sample ``i`` of the test stores holds ``i`` at
``[0, 0]``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from lmdbstore import EpochBatchSampler, LmdbBatchDataset, make_loader
from lmdbstore.config import LoaderConfig


class Recorder(pl.LightningModule):
    def __init__(self, store: str, batch: int, **loader: Any):
        super().__init__()
        self.store, self.batch, self.loader = store, batch, loader
        self.layer = torch.nn.Linear(625, 5)
        self.seen: dict[int, list[list[int]]] = {}

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        ds = LmdbBatchDataset(self.store)
        sampler = EpochBatchSampler(np.arange(len(ds)), self.batch, seed=3)  # rank and world from the process group
        return make_loader(ds, sampler, LoaderConfig(batch_size=self.batch, **self.loader))

    def training_step(self, batch, _):  # type: ignore[no-untyped-def]
        x, y = batch
        self.seen.setdefault(self.current_epoch, []).append(x[:, 0, 0, 0].round().long().tolist())
        return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)
