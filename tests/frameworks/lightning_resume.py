"""A Lightning run over make_loader (2 workers, CPU) checkpointed every ``EVERY`` steps by ``ModelCheckpoint``,
then a second run resumed from its checkpoint inside the second epoch: ``python lightning_resume.py STORE OUT``.
Writes ``OUT/result.json``: the sample numbers of every batch each run trained, per epoch, the loader state
Lightning saved in the checkpoint, and the warnings each run gave."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from lightning_recorder import Recorder
from pytorch_lightning.callbacks import ModelCheckpoint

EPOCHS, BATCH, EVERY = 2, 125, 5  # 2,000 samples: 16 batches an epoch; a checkpoint every 5 steps
RESUME_AT = "epoch=1-step=25.ckpt"  # after 9 batches of the second epoch


def fit(store: str, ckpts: Path, resume: Path | None) -> tuple[dict[int, list[list[int]]], list[str]]:
    model = Recorder(store, BATCH, workers=2, multiprocessing_context="fork")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=EVERY, save_top_k=-1)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=resume)
    return model.seen, [str(w.message) for w in caught]


if __name__ == "__main__":
    store, out = sys.argv[1], Path(sys.argv[2])
    full, full_warnings = fit(store, out / "full", None)
    ckpt = torch.load(out / "full" / RESUME_AT, weights_only=False)
    resumed, resumed_warnings = fit(store, out / "resumed", out / "full" / RESUME_AT)
    result = {
        "full": full,
        "resumed": resumed,
        "loader_state": ckpt["loops"]["fit_loop"]["state_dict"].get("combined_loader"),
        "warnings": full_warnings + resumed_warnings,
    }
    (out / "result.json").write_text(json.dumps(result))
