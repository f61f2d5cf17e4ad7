"""TensorBoard scalars from the trainer (lmdbstore.training.tboard), read back with TensorBoard's own
reader: loss, learning rate, validation loss and accuracy, samples/s and data wait; written without loading
TensorFlow; a resumed run's event file drops what the killed run logged after its checkpoint."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import REPO, StoreInfo

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmdbstore.training.tboard import EVENTS_PREFIX, open_scalar_log

TRAIN = """
import sys
from lmdbstore.config import LoaderConfig, TrainConfig
from lmdbstore.training.trainer import train
train(sys.argv[1], sys.argv[2], TrainConfig(epochs=2, width=4, device="cpu", log_every=2),
      LoaderConfig(batch_size=200, workers=0), log=None, progress=False)
print(sorted(m for m in ("tensorflow", "keras") if m in sys.modules))
"""


@pytest.fixture(autouse=True)
def _tensorboard_without_tensorflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard's reader on its own TensorFlow-free implementation (``tensorboard.compat.notf`` importable: its
    switch for builds without TensorFlow; the choice is made once per process, at the first read), not on
    TensorFlow, which would load all of TensorFlow and start its runtime in the test process (seconds, and forked
    DataLoader workers of the tests after it no longer safe)."""
    monkeypatch.setitem(sys.modules, "tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_the_trainer_logs_its_scalars_without_loading_tensorflow(small_store: StoreInfo, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN, str(small_store.path), str(run)], capture_output=True, text=True, cwd=REPO,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"  # neither TensorFlow nor Keras came in with TensorBoard
    got = _scalars(run)
    steps = 9  # 1,800 training samples in batches of 200
    assert [s for s, _ in got["train/loss"]] == list(range(2, 2 * steps + 1, 2))
    assert len(got["train/lr"]) == steps
    for tag in (
        "epoch/train_loss",
        "epoch/val_loss",
        "epoch/val_accuracy",
        "epoch/samples_per_s",
        "epoch/data_wait_share",
    ):
        assert [s for s, _ in got[tag]] == [steps, 2 * steps], tag
    assert all(v > 0 for _, v in got["epoch/samples_per_s"])
    assert all(0 <= v <= 1 for _, v in got["epoch/val_accuracy"] + got["epoch/data_wait_share"])


def test_a_resumed_log_drops_the_steps_logged_after_the_checkpoint(tmp_path: Path) -> None:
    first = open_scalar_log(tmp_path, resumed_at=None, fresh=True)
    assert first is not None
    for step in range(1, 11):
        first.scalars(step, {"train/loss": float(step)})
    first.close()
    resumed = open_scalar_log(tmp_path, resumed_at=6, fresh=False)  # killed after step 10, checkpoint at 6
    assert resumed is not None
    for step in range(7, 13):
        resumed.scalars(step, {"train/loss": 100.0 + step, "none": None, "nan": float("nan")})
    resumed.close()
    assert len(list(tmp_path.glob(f"{EVENTS_PREFIX}*"))) == 2
    loss = _scalars(tmp_path)["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 13))  # every step once
    assert [v for s, v in loss if s > 6] == [100.0 + s for s in range(7, 13)]
    fresh = open_scalar_log(tmp_path, resumed_at=None, fresh=True)  # a new run: the old files go
    assert fresh is not None
    fresh.close()
    assert len(list(tmp_path.glob(f"{EVENTS_PREFIX}*"))) == 1
