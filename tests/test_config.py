"""Frozen configuration dataclasses: defaults in one place, bad values refused with the parameter named."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

from lmdbstore import config
from lmdbstore.config import LoaderConfig, TrainConfig, WriterConfig


def test_defaults_and_frozen() -> None:
    w, ld, t = WriterConfig(), LoaderConfig(), TrainConfig()
    assert (w.checksum, w.commit_bytes, w.sync) == ("crc32", 64 << 20, True)
    assert (ld.batch_size, ld.order, ld.block_buffer) == (4096, "auto", 2)
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


def test_every_named_default_is_exported_and_documented() -> None:
    """Each module-level constant of config.py is in ``__all__`` and has a ``#:`` comment saying what it is for."""
    source = inspect.getsource(config)
    lines = source.splitlines()
    names = [
        (node.targets[0].id, node.lineno)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
    ]
    assert {"DEFAULT_DPI", "DEFAULT_SYNTH_SAMPLES", "DEFAULT_EXPORT_CHUNK"} <= {n for n, _ in names}
    undocumented = [n for n, line in names if not lines[line - 2].startswith("#:")]
    assert not undocumented
    assert not [n for n, _ in names if n.startswith("DEFAULT_") and n not in config.__all__]
