"""cli/cmd_export.py: ``export`` (classes, a split, an indices file, the split of a run after the store grew, a
set of stores; its errors as one line) and ``copy`` (verified, compacted, never over an existing destination); the
leftovers of a killed copy or export are removed by the next one, and nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    CLASSES,
    SET_CLASSES,
    SetInfo,
    StoreInfo,
    build_store,
    make_data,
    one_error_line,
    run_cli,
    snapshot_store,
)

from lmdbstore import LmdbStoreError, open_reader, open_writer
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.tools.copy import copy_store
from lmdbstore.tools.export import export_store


def test_export_then_ingest_the_export_and_a_store(small_store: StoreInfo, tmp_path: Path) -> None:
    r = run_cli("export", small_store.path, tmp_path / "ab.npz", "--classes", "a,b", "--no-progress")
    assert r.exit_code == 0, r.output
    keep = np.isin(small_store.y, [0, 1])
    assert f"exported {int(keep.sum()):,} samples of 2 classes (a, b)" in r.stdout
    r = run_cli("ingest", tmp_path / "n", tmp_path / "ab.npz", "--no-progress")
    assert r.exit_code == 0, r.output
    r = run_cli(
        "ingest", tmp_path / "m", small_store.path, tmp_path / "n", "--classes", ",".join(CLASSES), "--no-progress"
    )
    assert r.exit_code == 0, r.output
    with open_reader(tmp_path / "m") as rd:
        assert len(rd) == 2000 + int(keep.sum())
        x = rd.read_range(0, len(rd))
    assert np.array_equal(x.view(np.uint8), np.concatenate([small_store.x, small_store.x[keep]]).view(np.uint8))


def test_export_split_and_indices_file(small_store: StoreInfo, tmp_path: Path) -> None:
    r = run_cli(
        "export", small_store.path, tmp_path / "v.h5", "--split", "val", "--val-fraction", "0.25", "--no-progress"
    )
    assert r.exit_code == 0, r.output
    np.savetxt(tmp_path / "i.txt", [7, 3], fmt="%d")
    r = run_cli("export", small_store.path, tmp_path / "i.npy", "--indices", tmp_path / "i.txt", "--no-progress")
    assert r.exit_code == 0, r.output
    assert np.array_equal(np.load(tmp_path / "i.npy"), small_store.x[[7, 3]])


def test_export_split_of_a_run_is_exactly_its_samples_after_the_store_grew(tmp_path: Path) -> None:
    """Issue 39: ``export --split val --checkpoint RUN`` gives the run's held-out samples (drawn over the store as
    the run split it, and never a sample it trained on), and a store that is not the run's is one line."""
    x, y = make_data(400, shape=(4, 4))
    store, out = build_store(tmp_path / "s", x, y), tmp_path / "run"
    args = ("--epochs", "1", "--batch", "100", "--workers", "0", "--no-progress", "--val-fraction", "0.2")
    assert run_cli("train", store, "--out", out, *args).exit_code == 0
    with open_writer(store) as w:
        w.append(*make_data(400, seed=4, shape=(4, 4)))
    ckpt = out / "checkpoint.pt"
    r = run_cli("export", store, tmp_path / "v.npy", "--split", "val", "--checkpoint", ckpt, "--no-progress")
    assert r.exit_code == 0, r.output
    _, val_idx = stratified_split(y, 0.2, 0)
    assert np.array_equal(np.load(tmp_path / "v.npy"), x[val_idx])
    again = run_cli("export", store, tmp_path / "w.npy", "--split", "val", "--checkpoint", ckpt, "--seed", "1")
    assert again.exit_code == 1 and "without --val-fraction or --seed" in one_error_line(again)
    other = build_store(tmp_path / "o", *make_data(400, seed=5, shape=(4, 4)))
    r = run_cli("export", other, tmp_path / "w.npy", "--split", "val", "--checkpoint", ckpt, "--no-progress")
    assert r.exit_code == 1 and "the store changed since the run split its first 400 samples" in one_error_line(r)


def test_export_errors_are_one_line(small_store: StoreInfo, tmp_path: Path) -> None:
    before = snapshot_store(small_store.path)
    for args, text in (
        (("--classes", "nope"), "unknown class 'nope'"),
        (("--split", "test"), "split must be one of"),
        (("--indices", tmp_path / "missing.txt"), "indices: cannot read"),
    ):
        r = run_cli("export", small_store.path, tmp_path / "o.npz", *args, "--no-progress")
        assert r.exit_code == 1 and text in one_error_line(r)
    r = run_cli("export", tmp_path / "nostore", tmp_path / "o.npz", "--no-progress")
    assert r.exit_code == 1 and "no such store" in one_error_line(r)
    assert not (tmp_path / "o.npz").exists()
    assert snapshot_store(small_store.path) == before


def test_copy_verifies_and_refuses_an_existing_destination(small_store: StoreInfo, tmp_path: Path) -> None:
    r = run_cli("copy", small_store.path, tmp_path / "c", "--compact")
    assert r.exit_code == 0 and "(compacted)" in r.stdout, r.output
    r = run_cli("verify", tmp_path / "c", "--no-progress")
    assert r.exit_code == 0 and "OK" in r.stdout
    r = run_cli("copy", small_store.path, tmp_path / "c")
    assert r.exit_code == 1 and "destination exists" in one_error_line(r)


def test_export_a_set(three: SetInfo, tmp_path: Path) -> None:
    out = tmp_path / "all.npz"
    r = run_cli("export", *three.paths, out, "--no-progress")
    assert r.exit_code == 0, r.output
    with np.load(out) as z:
        np.testing.assert_array_equal(z["x"], three.x)
        assert list(z["class_names"]) == SET_CLASSES
        np.testing.assert_array_equal(np.asarray(SET_CLASSES)[z["y"]], three.names)
    r = run_cli("export", *three.paths, tmp_path / "x.npz", "--classes", "x", "--no-progress")
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "x.npz") as z:  # the class only the second store has
        assert len(z["x"]) == int((three.names == "x").sum()) and list(z["class_names"]) == ["x"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_copys_leftover_is_removed_by_the_next_copy(small_store: StoreInfo, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dead = _dead_pid()
    leftover = tmp_path / f".dest.copy-{dead}"  # what a copy killed mid-way leaves
    leftover.mkdir()
    (leftover / "data.mdb").write_bytes(b"\0" * 8192)
    users = tmp_path / f".dest.copy-{dead + 1}"  # same pattern, but a user's files: never touched
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    live = tmp_path / f".dest.copy-{os.getppid()}"  # a copy still running
    live.mkdir()
    (live / "data.mdb").write_bytes(b"")
    near = tmp_path / f".dest.copy-{dead}x"
    near.write_text("not the pattern")
    copy_store(small_store.path, dest)
    assert not leftover.exists()
    assert (users / "notes.txt").read_text() == "mine" and live.exists() and near.exists()
    assert (dest / "data.mdb").exists()


def test_a_killed_exports_leftover_is_removed_by_the_next_export(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    dead = _dead_pid()
    leftover = tmp_path / f".out.npz.part-{dead}"
    leftover.write_bytes(b"partial zip")
    other = tmp_path / f".other.npz.part-{dead}"  # another target's: not this export's to remove
    other.write_bytes(b"x")
    export_store(small_store.path, out)
    assert not leftover.exists() and other.exists() and out.exists()


def test_copy_errors_name_the_destination(small_store: StoreInfo, tmp_path: Path) -> None:
    with pytest.raises(LmdbStoreError, match="does not exist"):
        copy_store(small_store.path, tmp_path / "no" / "such" / "dir")
