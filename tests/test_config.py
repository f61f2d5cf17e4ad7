"""Frozen configuration dataclasses: defaults in one place, bad values refused with the parameter named."""

from __future__ import annotations

import dataclasses

import pytest

from lmdbstore.config import LoaderConfig, TrainConfig, WriterConfig


def test_defaults_and_frozen() -> None:
    w, ld, t = WriterConfig(), LoaderConfig(), TrainConfig()
    assert (w.checksum, w.commit_bytes, w.sync) == ("crc32", 64 << 20, True)
    assert (ld.batch_size, ld.shuffle, ld.block_buffer) == (4096, "auto", 2)
    assert (t.epochs, t.val_fraction, t.device) == (3, 0.1, "auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ld.batch_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (WriterConfig, {"samples_per_value": 0}, "samples_per_value"),
        (WriterConfig, {"checksum": "md5"}, "checksum"),
        (WriterConfig, {"commit_bytes": 0}, "commit_bytes"),
        (WriterConfig, {"initial_map_size": 10}, "initial_map_size"),
        (WriterConfig, {"initial_map_size": 1 << 30, "max_map_size": 1 << 20}, "initial_map_size"),
        (LoaderConfig, {"batch_size": 0}, "batch_size"),
        (LoaderConfig, {"shuffle": "sorted"}, "shuffle"),
        (LoaderConfig, {"block_buffer": 0}, "block_buffer"),
        (LoaderConfig, {"workers": -1}, "workers"),
        (LoaderConfig, {"multiprocessing_context": "thread"}, "multiprocessing_context"),
        (TrainConfig, {"epochs": 0}, "epochs"),
        (TrainConfig, {"lr": 0.0}, "lr"),
        (TrainConfig, {"val_fraction": 1.0}, "val_fraction"),
        (TrainConfig, {"width": 0}, "width"),
        (TrainConfig, {"max_steps_per_epoch": 0}, "max_steps_per_epoch"),
    ],
)
def test_bad_values_name_the_parameter(cls: type, kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)
