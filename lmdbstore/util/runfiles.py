"""The files of a training run directory, named once: the trainer writes them, the pictures and the CLI read
them (torch-free, so ``plot`` needs no torch)."""

from __future__ import annotations

__all__ = ["BEST_NAME", "CHECKPOINT_NAME", "METRICS_NAME", "SUMMARY_NAME"]

#: One JSON object per epoch, appended as the run goes.
METRICS_NAME = "metrics.jsonl"
#: Written at the end: the classes, the validation confusion matrix, the last epoch, the store.
SUMMARY_NAME = "summary.json"
#: The latest checkpoint (every epoch); ``--resume`` continues from it.
CHECKPOINT_NAME = "checkpoint.pt"
#: The checkpoint of the best validation accuracy so far.
BEST_NAME = "best.pt"
