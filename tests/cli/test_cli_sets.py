"""``stats``, ``verify``, ``export`` and ``train`` over a set of stores (``lmdbstore CMD A B C``), through
typer's CliRunner: the set's figures by class name, a damaged store named in its set, stores
that make no set refused in one line, the export and the training run covering the whole set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    SET_CLASSES,
    SetInfo,
    build_set,
    build_store,
    damage_store,
    make_data,
    one_error_line,
    run_cli,
)

from lmdbstore.loader.samplers import stratified_split
from lmdbstore.tools.set_tools import set_stats, verify_set


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> SetInfo:
    return build_set(tmp_path_factory.mktemp("set"))


def test_stats_of_a_set_by_class_name(three: SetInfo) -> None:
    r = run_cli("stats", *three.paths, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert [d["samples"] for d in s["stores"]] == [1000, 517, 263]
    whole = s["set"]
    assert whole["samples"] == 1780 and whole["store_samples"] == [1000, 517, 263]
    assert [c["name"] for c in whole["classes"]] == SET_CLASSES
    assert [c["count"] for c in whole["classes"]] == [int((three.names == c).sum()) for c in SET_CLASSES]
    assert whole["values"]["mean"] == pytest.approx(float(three.x.astype(np.float64).mean()), rel=1e-6)
    sampled = set_stats(three.paths, sample=500)["set"]["values"]
    assert sampled["method"].startswith("random sample of 500 of 1780")
    r = run_cli("stats", *three.paths)
    assert r.exit_code == 0, r.output
    assert "3 stores read as one" in r.stdout and "1,780 (1,000 + 517 + 263)" in r.stdout


def test_verify_a_set_names_the_damaged_store(three: SetInfo, tmp_path: Path) -> None:
    r = run_cli("verify", *three.paths, "--no-progress")
    assert r.exit_code == 0, r.output
    assert r.stdout.count(": OK") == 3
    report = verify_set(three.paths)
    assert report.ok and [x.count for x in report.reports] == [1000, 517, 263]
    broken = build_set(tmp_path, [(300, ["a", "b"]), (400, ["b", "c"])])
    damage_store(broken.paths[1], "zero_leaf")
    r = run_cli("verify", *broken.paths, "--no-progress")
    assert r.exit_code == 1
    assert f"{broken.paths[0]}: OK" in r.stdout and f"{broken.paths[1]}: " in r.stdout
    assert f"of {broken.paths[1]}: [" in r.stdout  # each problem line names its store


def test_stores_that_make_no_set_are_refused_in_one_line(three: SetInfo, tmp_path: Path) -> None:
    x, y = make_data(50, 1, shape=(24, 25))
    odd = build_store(tmp_path / "odd", x, y)
    for args, code in ((["stats"], 1), (["verify", "--no-progress"], 2), (["train", "--no-progress"], 1)):
        r = run_cli(args[0], three.paths[0], odd, *args[1:])
        assert r.exit_code == code, (args, r.output)
        line = one_error_line(r)
        assert "odd: samples of shape (24, 25) float32 differ from the set's first store" in line
    r = run_cli("stats", three.paths[0], three.paths[0])
    assert r.exit_code == 1 and "given twice" in one_error_line(r)


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


def test_train_on_a_set(three: SetInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--batch", "128", "--epochs", "1", "--workers", "1", "--no-progress", "--out", out, "--device", "cpu"]
    r = run_cli("train", *three.paths, *args, "--shuffle", "block")
    assert r.exit_code == 0, r.output
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_idx, _ = stratified_split(np.searchsorted(SET_CLASSES, three.names), 0.1, 0)
    assert metrics[0]["train_samples"] == len(train_idx)  # the whole set's training split, once
    assert json.loads((out / "summary.json").read_text())["classes"] == SET_CLASSES


def test_train_on_a_set_with_weights(three: SetInfo, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--batch", "128", "--epochs", "1", "--workers", "0", "--no-progress", "--out", out, "--device", "cpu"]
    r = run_cli("train", *three.paths, *args, "--weights", "0.2,0.3,0.5", "--max-steps", "2", "--width", "4")
    assert r.exit_code == 0, r.output
    # finite weights whose sum overflows: every training sample once per epoch, not 1 per store (issue 34 #2)
    big = tmp_path / "big"
    r = run_cli("train", *three.paths, *args[:-4], "--out", big, "--weights", "1e308,1e308,1e308", "--width", "4")
    assert r.exit_code == 0, r.output
    metrics = [json.loads(line) for line in (big / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["train_samples"] == len(stratified_split(np.searchsorted(SET_CLASSES, three.names), 0.1, 0)[0])
    for bad, msg in ((["--weights", "1,x"], "--weights must be comma-separated numbers"),
                     (["--weights", "1,1"], "weights: 2 numbers for 3 stores"),
                     (["--weights", "1,1,1", "--shuffle", "block"], "shuffle must be 'random' or 'auto'")):  # fmt: skip
        r = run_cli("train", *three.paths, *args, *bad, "--overwrite")
        assert r.exit_code == 1 and msg in one_error_line(r)
        assert (out / "checkpoint.pt").exists()  # refused before --overwrite removed the earlier run
