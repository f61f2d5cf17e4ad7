"""A Lightning run with ``strategy="ddp"``, 2 CPU processes (gloo), the defaults otherwise, over make_loader,
checkpointed every ``EVERY`` steps, then a second run resumed from a checkpoint inside the second epoch:
``python lightning_ddp.py STORE OUT`` (Lightning re-runs this file for the second process).  Each rank writes
the sample numbers of every batch each run trained on, per epoch, to ``OUT/rank<r>.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
from lightning_recorder import Recorder
from pytorch_lightning.callbacks import ModelCheckpoint

EPOCHS, BATCH, EVERY = 3, 50, 7  # 2,000 samples, 2 ranks: 20 batches a rank an epoch
RESUME_AT = "epoch=1-step=28.ckpt"  # after 8 batches of the second epoch


def fit(store: str, ckpts: Path, resume: Path | None) -> tuple[int, dict[int, list[list[int]]]]:
    model = Recorder(store, BATCH, workers=1)
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=EVERY, save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(model, ckpt_path=resume)
    return trainer.global_rank, model.seen


if __name__ == "__main__":
    store, out = sys.argv[1], Path(sys.argv[2])
    rank, full = fit(store, out / "full", None)
    _, resumed = fit(store, out / "resumed", out / "full" / RESUME_AT)
    (out / f"rank{rank}.json").write_text(json.dumps({"full": full, "resumed": resumed}))
