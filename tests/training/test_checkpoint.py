"""Checkpoints (``lmdbstore.training.checkpoint``, resumed by ``lmdbstore.training.resume``): real files
written by ``atomic_save`` and by the trainer, loaded with ``torch.load(weights_only=True)``, and every
wrong, oversized, damaged or hostile one refused with one ``LmdbStoreError`` line naming the file."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CLASSES, build_store, make_data

from lmdbstore import LmdbStoreError, ValidationError
from lmdbstore.config import BUILTIN_MODEL, MAX_WIDTH, LoaderConfig, TrainConfig
from lmdbstore.format.limits import MAX_CLASSES, MAX_DIM
from lmdbstore.loader.choose import recorded_splits
from lmdbstore.training.checkpoint import (
    CHECKPOINT_FORMAT,
    atomic_save,
    check_checkpoint,
    load_checkpoint,
    load_weights,
    model_channels,
    model_from_checkpoint,
)
from lmdbstore.training.model import build_cnn
from lmdbstore.training.resume import restore_state
from lmdbstore.training.tboard import EVENTS_PREFIX
from lmdbstore.training.trainer import train
from lmdbstore.util.runfiles import BEST_NAME, CHECKPOINT_NAME

SHAPE = (16, 16)


def _state(shape: tuple[int, ...] = SHAPE, classes: list[str] = CLASSES, width: int = 8) -> dict[str, Any]:
    """What a checkpoint holds for a fresh model (no resume state): the model's own weights and claims."""
    torch.manual_seed(0)
    model = build_cnn(shape, len(classes), width)
    return {
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(),
        "classes": list(classes),
        "sample_shape": list(shape),
        "in_channels": shape[0] if len(shape) == 3 else 1,
        "width": width,
        "model_factory": BUILTIN_MODEL,
        "model_args": json.dumps({"width": width}),
    }


def _refused(path: Path, words: str) -> LmdbStoreError:
    """``load_checkpoint(path)`` fails with one line that names ``path`` and matches ``words``."""
    with pytest.raises(LmdbStoreError, match=words) as err:
        load_checkpoint(path)
    assert "\n" not in str(err.value) and err.value.path == str(path)
    return err.value


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of a real one-epoch training run (3 steps) on a 16x16 store."""
    base = tmp_path_factory.mktemp("ckpt")
    store = build_store(base / "store", *make_data(400, seed=4, shape=SHAPE))
    out = base / "run"
    cfg = TrainConfig(epochs=1, lr=5e-3, width=8, max_steps_per_epoch=3)
    train(store, out, cfg, LoaderConfig(batch_size=64, workers=0), log=None, progress=False)
    return out


# ---------------------------------------------------------------------- real checkpoints load
def test_trainer_checkpoints_load_safely_and_rebuild_the_model(trained: Path) -> None:
    for name in (CHECKPOINT_NAME, BEST_NAME):
        ckpt = load_checkpoint(trained / name)
        assert ckpt["format"] == CHECKPOINT_FORMAT and ckpt["classes"] == CLASSES
        assert ckpt["sample_shape"] == list(SHAPE) and ckpt["in_channels"] == 1 and ckpt["width"] == 8
        assert ckpt["epoch"] == 0 and isinstance(ckpt["history"], str)
        check_checkpoint(ckpt, CLASSES, SHAPE, trained / name)  # the store it was trained on: accepted
        model = model_from_checkpoint(ckpt, trained / name)
        for key, tensor in model.state_dict().items():
            assert torch.equal(tensor, ckpt["model"][key])
    # written by temp-then-rename: nothing but the run's own files is left in the directory
    files = sorted(p.name for p in trained.iterdir() if not p.name.startswith(EVENTS_PREFIX))  # TensorBoard's
    assert files == sorted([CHECKPOINT_NAME, BEST_NAME, "metrics.jsonl", "summary.json"])


def test_atomic_save_writes_and_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_NAME
    atomic_save(_state(width=8), path)
    assert load_checkpoint(path)["width"] == 8
    atomic_save(_state(width=4), path)  # over an existing checkpoint
    assert load_checkpoint(path)["width"] == 4
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]


@pytest.mark.parametrize("key", ["in_channels", "model_factory", "model_args"])
def test_checkpoints_without_a_recorded_field_are_refused(tmp_path: Path, key: str) -> None:
    state = _state(shape=(3, 16, 16))
    del state[key]  # checkpoints from before it was stored
    atomic_save(state, tmp_path / "old.pt")
    _refused(tmp_path / "old.pt", f"not an lmdbstore checkpoint \\(no {key}\\)")


# ---------------------------------------------------------------------- not a checkpoint of this format
@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ([1, 2, 3], "not an lmdbstore checkpoint"),
        ({"model": {}}, "not an lmdbstore checkpoint"),  # no format
        ({**_state(), "format": CHECKPOINT_FORMAT + 1}, "not an lmdbstore checkpoint"),
        (
            {"format": CHECKPOINT_FORMAT, "model": {}},
            r"not an lmdbstore checkpoint \(no classes, in_channels, model_args, model_factory, sample_shape, width\)",
        ),
    ],
    ids=["list", "no-format", "other-format", "missing-keys"],
)
def test_other_payloads_are_refused(tmp_path: Path, payload: object, words: str) -> None:
    path = tmp_path / "c.pt"
    torch.save(payload, path)
    _refused(path, words)


# ---------------------------------------------------------------------- claims bounded before anything is built
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"width": 0}, "width 0 is not in"),
        ({"width": MAX_WIDTH + 1}, f"width {MAX_WIDTH + 1} is not in 1..{MAX_WIDTH}"),
        ({"width": True}, "width True is not in"),  # a bool is not a width
        ({"classes": []}, f"classes must be a list of 1..{MAX_CLASSES} names"),
        ({"classes": [1, 2, 3, 4, 5]}, "classes must be a list"),
        ({"classes": [str(i) for i in range(MAX_CLASSES + 1)]}, "classes must be a list"),
        ({"sample_shape": [0, 16]}, f"sample_shape must be a list of dimensions in 1..{MAX_DIM}"),
        ({"sample_shape": [MAX_DIM + 1, 16]}, "sample_shape must be"),
        ({"sample_shape": "16x16"}, "sample_shape must be"),
        ({"sample_shape": [2, 2]}, "malformed checkpoint: the CNN needs samples of at least 4x4"),
        ({"sample_shape": [64]}, "malformed checkpoint: the CNN takes 2-D"),
        ({"in_channels": 0}, "in_channels 0 is not in"),
        ({"in_channels": MAX_DIM + 1}, "in_channels"),
        ({"model": [1, 2]}, "model must be a state dict"),
    ],
    ids=lambda c: str(c)[:24],
)
def test_claims_out_of_bounds_are_refused(tmp_path: Path, change: dict[str, object], words: str) -> None:
    path = tmp_path / "c.pt"
    atomic_save({**_state(), **change}, path)
    _refused(path, words)


def test_oversized_claims_are_refused_without_allocating(tmp_path: Path) -> None:
    """The largest width it allows (about 1.2 G parameters) is checked against the weights' shapes on the
    meta device: refused at once, nothing of that size is built."""
    path = tmp_path / "c.pt"
    atomic_save({**_state(width=8), "width": MAX_WIDTH}, path)
    err = _refused(path, "checkpoint weights do not fit the model it describes")
    assert f"width {MAX_WIDTH}" in str(err)
    atomic_save({**_state(), "sample_shape": [MAX_DIM, MAX_DIM]}, path)  # any spatial size: weights fit
    assert load_checkpoint(path)["sample_shape"] == [MAX_DIM, MAX_DIM]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda w: w.pop("head.1.weight"), "head.1.weight is missing"),
        (lambda w: w.update({"head.1.bias": torch.zeros(7)}), r"head.1.bias is of shape \(7,\)"),
        (lambda w: w.update({"features.0.weight": [0.0]}), "features.0.weight is not a tensor"),
    ],
    ids=["missing", "shape", "not-a-tensor"],
)
def test_weights_that_are_not_the_claimed_model_are_refused(
    tmp_path: Path, edit: Callable[[dict[str, Any]], object], words: str
) -> None:
    state = _state()
    edit(state["model"])
    path = tmp_path / "c.pt"
    atomic_save(state, path)
    _refused(path, words)


# ---------------------------------------------------------------------- wrong store, wrong model
def test_checkpoint_of_other_classes_or_shape_is_refused(trained: Path) -> None:
    path = trained / CHECKPOINT_NAME
    ckpt = load_checkpoint(path)
    for classes, shape in ((["x", "y"], SHAPE), (CLASSES, (20, 20))):
        with pytest.raises(
            LmdbStoreError, match=r"checkpoint was trained on classes \[.*\] and shape \(16, 16\)"
        ) as err:
            check_checkpoint(ckpt, classes, shape, path)
        assert "\n" not in str(err.value) and err.value.path == str(path)
    with pytest.raises(LmdbStoreError, match=r"1-channel samples.*3-channel samples") as err:
        check_checkpoint(ckpt, CLASSES, (3, 16, 16), path)
    assert err.value.hint is not None


def test_weights_into_a_model_of_another_width_are_one_line(trained: Path) -> None:
    ckpt = load_checkpoint(trained / CHECKPOINT_NAME)
    with pytest.raises(LmdbStoreError, match=r"checkpoint weights do not fit the model \(") as err:
        load_weights(build_cnn(SHAPE, len(CLASSES), 16), ckpt, trained / CHECKPOINT_NAME)
    assert "\n" not in str(err.value)


def test_shapes_the_cnn_cannot_take_are_a_validation_error(tmp_path: Path) -> None:
    assert model_channels((3, 16, 16), tmp_path) == 3 and model_channels(SHAPE, tmp_path) == 1
    with pytest.raises(ValidationError, match=r"4-D samples .* -- hint: the CNN trains on"):
        model_channels((2, 3, 16, 16), tmp_path)


# ---------------------------------------------------------------------- resume state
@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"epoch": -1}, r"cannot be resumed \(epoch -1 is not a non-negative integer\)"),
        ({"epoch": "3"}, "epoch '3' is not"),
        ({"history": "not json"}, r"cannot be resumed \(Expecting value"),
        ({"history": '[{"epoch": 0}]'}, r"cannot be resumed \(.*missing"),
        ({"confusion": [[1, 2], [3, 4]]}, r"confusion matrix of shape \(2, 2\), expected 5x5"),
        ({"optimizer": {"state": {}}}, r"cannot be resumed \("),
    ],
    ids=lambda c: str(c)[:20],
)
def test_resume_state_that_is_malformed_is_one_line(trained: Path, change: dict[str, object], words: str) -> None:
    path = trained / CHECKPOINT_NAME
    ckpt = {**load_checkpoint(path), **change}
    model = build_cnn(SHAPE, len(CLASSES), 8)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(LmdbStoreError, match=words) as err:
        restore_state(ckpt, optimizer, len(CLASSES), path)
    assert "\n" not in str(err.value) and err.value.path == str(path)


def test_resume_state_of_a_real_checkpoint(trained: Path) -> None:
    path = trained / CHECKPOINT_NAME
    model = build_cnn(SHAPE, len(CLASSES), 8)
    optimizer = torch.optim.AdamW(model.parameters())
    state = restore_state(load_checkpoint(path), optimizer, len(CLASSES), path)
    assert state.start_epoch == 1 and [m.epoch for m in state.history] == [1]  # epochs count from 1
    assert state.confusion is not None and state.confusion.shape == (5, 5)
    assert optimizer.state_dict()["state"]  # the saved moments are back


# ---------------------------------------------------------------------- damaged and hostile files
def test_missing_truncated_and_garbage_files_are_refused(trained: Path, tmp_path: Path) -> None:
    _refused(tmp_path / "nope.pt", "no such checkpoint")
    _refused(tmp_path, "no such checkpoint")  # a directory
    data = (trained / CHECKPOINT_NAME).read_bytes()
    for name, content in (
        ("truncated.pt", data[: len(data) // 2]),
        ("empty.pt", b""),
        ("garbage.pt", np.random.default_rng(0).bytes(4096)),
        ("text.pt", b"checkpoint\n" * 100),
    ):
        (tmp_path / name).write_bytes(content)
        _refused(tmp_path / name, "cannot load checkpoint")


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_pickled_object_payload_is_refused_and_runs_no_code(tmp_path: Path, writer: str) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.mkdir, (str(marker),))  # what unpickling would run

    path = tmp_path / "evil.pt"
    payload = {"format": CHECKPOINT_FORMAT, "model": Evil(), "classes": CLASSES, "sample_shape": [16, 16], "width": 8}
    if writer == "pickle":
        path.write_bytes(pickle.dumps(payload, protocol=2))
    else:
        torch.save(payload, path)
    _refused(path, "cannot load checkpoint")
    assert not marker.exists()


def test_the_split_record_is_checked_by_the_one_rule_of_its_fields(trained: Path) -> None:
    """Issue 39: a count (``val_fraction=200``) is a valid split (``eval`` refused it as malformed); a record out of
    range, malformed or missing is one line."""
    ckpt, path = load_checkpoint(trained / CHECKPOINT_NAME), trained / CHECKPOINT_NAME
    (record,) = json.loads(ckpt["split"])
    assert (record["val_fraction"], record["seed"], record["samples"]) == (0.1, 0, 400)
    ckpt["split"] = json.dumps([{**record, "val_fraction": 200}])
    assert recorded_splits(ckpt, path)[0].val_fraction == 200
    for bad, words in [
        ([{**record, "val_fraction": 1.5}], "val_fraction must be a share"),
        ([{**record, "seed": "0"}], "seed must be an integer"),
        ([{**record, "extra": 1}], "unexpected keyword"),
        ([], "index out of range"),
    ]:
        ckpt["split"] = json.dumps(bad)
        with pytest.raises(LmdbStoreError, match="malformed checkpoint: its split record .*" + words):
            recorded_splits(ckpt, path)
    del ckpt["split"]
    with pytest.raises(LmdbStoreError, match="records no split"):
        recorded_splits(ckpt, path)
