"""cli/cmd_inspect.py: ``stats`` and ``verify`` of a store and of a set of stores (the set's figures by class
name, a damaged store named in its set), missing and foreign stores, stores that make no set: one line each."""

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

from lmdbstore.tools.set_tools import set_stats, verify_set


def test_missing_and_foreign_stores(tmp_path: Path) -> None:
    for cmd, code in (("stats", 1), ("verify", 2)):
        r = run_cli(cmd, tmp_path / "nope")
        assert r.exit_code == code and "no such store" in one_error_line(r)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text("hello")
    r = run_cli("stats", tmp_path / "dir")
    assert r.exit_code == 1 and "not a store" in one_error_line(r)
    r = run_cli("train", tmp_path / "dir", "--no-progress")
    assert r.exit_code == 1 and "not a store" in one_error_line(r)


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
