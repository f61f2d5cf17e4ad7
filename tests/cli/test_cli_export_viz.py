"""CLI: export, copy, ingest from a store, show, plot, stats --plot, train --plot (CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, StoreInfo, build_store, make_data, one_error_line, run_cli, snapshot_store

from lmdbstore import open_reader, open_writer
from lmdbstore.loader.samplers import stratified_split


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


def test_show_plot_and_stats_plot(small_store: StoreInfo, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    r = run_cli("show", small_store.path, "-o", tmp_path / "s.png", "--per-class", "4", "--seed", "3")
    assert r.exit_code == 0 and "s.png (640x720 px)" in r.stdout, r.output
    with Image.open(tmp_path / "s.png") as im:
        assert im.size == (640, 720)
    r = run_cli("show", small_store.path, "-o", tmp_path / "t.png", "--indices", "1,2,x")
    assert r.exit_code == 1 and "comma-separated integers" in one_error_line(r)
    r = run_cli("stats", small_store.path, "--plot", tmp_path / "st.png")
    assert r.exit_code == 0 and "wrote" in r.stdout
    with Image.open(tmp_path / "st.png") as im:
        assert im.size == (1200, 420)
    r = run_cli("plot", tmp_path / "norun", "-o", tmp_path / "p.png")
    assert r.exit_code == 1 and "metrics" in one_error_line(r)


def test_train_plot_then_plot_two_runs(small_store: StoreInfo, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    for name in ("r1", "r2"):
        r = run_cli("train", small_store.path, "--epochs", "2", "--batch", "256", "--workers", "0", "--width", "4",
                    "--device", "cpu", "--out", tmp_path / name, "--plot", "--no-progress")  # fmt: skip
        assert r.exit_code == 0, r.output
        with Image.open(tmp_path / name / "run.png") as im:
            assert im.size == (1500, 420)
    r = run_cli("plot", tmp_path / "r1", tmp_path / "r2", "-o", tmp_path / "both.png", "--dpi", "50")
    assert r.exit_code == 0 and "(750x210 px)" in r.stdout, r.output
    assert json.loads((tmp_path / "r2" / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 2
