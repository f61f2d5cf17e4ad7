"""A Lightning run with ``strategy="ddp"``, 2 CPU processes (gloo), the defaults otherwise, over make_loader:
``python lightning_ddp.py STORE OUT`` (Lightning re-runs this file for the second process).  Each rank
writes the sample numbers of every batch it trained on, per epoch, to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

from lmdbstore import EpochBatchSampler, LmdbBatchDataset, make_loader
from lmdbstore.config import LoaderConfig

EPOCHS, BATCH = 3, 50


class Recorder(pl.LightningModule):
    def __init__(self, store: str):
        super().__init__()
        self.store = store
        self.layer = torch.nn.Linear(625, 5)
        self.seen: dict[int, list[list[int]]] = {}

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        ds = LmdbBatchDataset(self.store)
        sampler = EpochBatchSampler(np.arange(len(ds)), BATCH, seed=3)  # rank and world from the process group
        return make_loader(ds, sampler, LoaderConfig(batch_size=BATCH, workers=1))

    def training_step(self, batch, _):  # type: ignore[no-untyped-def]
        x, y = batch
        self.seen.setdefault(self.current_epoch, []).append(x[:, 0, 0, 0].round().long().tolist())
        return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    store, out = sys.argv[1], Path(sys.argv[2])
    model = Recorder(store)
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(model.seen))
