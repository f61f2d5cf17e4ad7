"""A training run's output directory before the run starts: an earlier run's files are never mixed with, or
silently replaced by, a new run's.  A directory holding an earlier run (its ``checkpoint.pt``, ``best.pt``,
``metrics.jsonl`` or ``summary.json``) is continued (``resume``), started afresh on purpose (``overwrite``: its
files are removed first), or refused (docs/design.md#model says why).
"""

from __future__ import annotations

from pathlib import Path

from lmdbstore.errors import LmdbStoreError
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME, METRICS_NAME, SUMMARY_NAME

__all__ = ["RUN_FILES", "prepare_run_dir", "remove_run_files"]

#: The files that say a directory holds a training run.
RUN_FILES = (CHECKPOINT_NAME, BEST_NAME, METRICS_NAME, SUMMARY_NAME)


def prepare_run_dir(out: Path, *, resume: bool, overwrite: bool) -> list[Path]:
    """Check the run files of ``out`` for a run about to start; return those ``overwrite`` will remove (by
    :func:`remove_run_files`, once every other check has passed).

    Raises:
        LmdbStoreError: ``out`` holds an earlier run and neither ``resume`` nor ``overwrite`` is given.
    """
    if resume:
        return []
    found = [name for name in RUN_FILES if (out / name).exists()]
    if not found:
        return []
    if not overwrite:
        raise LmdbStoreError(
            f"holds an earlier training run ({', '.join(found)}); a new run would replace its {BEST_NAME} "
            "even if worse",
            path=out,
            hint="continue it with resume=True, replace it with overwrite=True, or give another out_dir=",
        )
    return [out / name for name in found]


def remove_run_files(paths: list[Path]) -> None:
    """Remove an earlier run's files (:func:`prepare_run_dir`'s list).

    Raises:
        LmdbStoreError: one cannot be removed.
    """
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError as exc:
            raise LmdbStoreError(f"cannot remove the earlier run's {p.name} ({exc.strerror or exc})", path=p) from exc
