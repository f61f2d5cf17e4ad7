"""A Lightning run with ``strategy="ddp"``, 2 CPU processes (gloo), the defaults otherwise, over make_loader:
``python lightning_ddp.py STORE OUT`` (Lightning re-runs this file for the second process).  Each rank
writes the sample numbers of every batch it trained on, per epoch, to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
from lightning_recorder import Recorder

EPOCHS, BATCH = 3, 50


if __name__ == "__main__":
    store, out = sys.argv[1], Path(sys.argv[2])
    model = Recorder(store, BATCH, workers=1)
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(model.seen))
