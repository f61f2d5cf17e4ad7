"""Smoke tests of ``scripts/bench/ooc.py``: a tiny run measures every section on a real store and writes sane
numbers; its synthetic stores identify their samples; a given store is only read.

Speed is never asserted (the machine is shared); only that every configured measurement exists and is sane.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import build_store, dir_bytes, load_script, make_data

ooc = load_script("ooc")
ooc_runs = load_script("ooc_runs")

QUICK = ["--seconds", "0.05", "--batch", "256", "--warm-samples", "2000", "--window-mb", "1", "--workers", "0"]


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_quick_run_measures_every_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--samples", "3000", *QUICK, "--train-steps", "2", "--inflight", "1,16,64"]
    res = ooc.main([*args, "--workdir", str(work), "--out", str(out)])

    assert res["store"]["samples"] == 3000 and res["store"]["samples_per_value"] >= 1
    assert set(res["disk"]) == {f"{what} x{q}" for what in ("sample", "value") for q in (1, 16, 64)}
    assert all(_positive(v) for v in res["disk"].values())
    assert {k for k in res["one"] if _positive(res["one"][k])} >= {"random", "block", "window", "lmdb-random"}
    assert res["one"]["window first-window load s"] >= 0
    assert all(_positive(res["loader"][m]) for m in ("random", "block", "window"))
    assert all(_positive(res["warm"][k]) for k in ("random", "block", "memmap random", "memmap block"))
    for mode, q in res["quality"].items():
        assert 1 <= q["distinct values per batch"] <= 256, mode
        assert 0.0 <= q["class-mix TVD"] <= 1.0, mode
    assert res["memory"]["table MB"] >= 0 and math.isfinite(res["memory"]["reader RssAnon MB"])
    train = res["train"]
    assert train["steps"] == 2 and 0.0 <= train["data wait share"] <= 1.0 and _positive(train["samples/s"])

    report = (out / "bench_ooc.md").read_text()
    assert report.startswith("store: 3,000 samples")
    for row in ("| sample x 64 in flight |", "| random |", "| lmdb-random |", "| window |", "memory: position table"):
        assert row in report, row
    assert "of sample x16 |" in report and "of value x16 |" in report  # ratios to the disk limit, same run
    assert report in capsys.readouterr().out  # the tables are printed too
    assert json.loads((out / "bench_ooc.json").read_text())["disk"] == pytest.approx(res["disk"])
    assert not (work / "store").exists()  # the created store is removed without --keep


def test_a_given_store_is_only_read(tmp_path: Path) -> None:
    x, y = make_data(1500, seed=2)
    store = build_store(tmp_path / "store", x, y)
    before = dir_bytes(store)
    skip = ["--skip", "disk,loader,warm"]
    res = ooc.main(["--store", str(store), *QUICK, *skip, "--out", str(tmp_path / "out")])
    assert res["store"]["samples"] == 1500 and set(res) >= {"one", "quality", "memory"} and "disk" not in res
    assert dir_bytes(store) == before


@pytest.mark.parametrize("sorted_classes", [False, True])
def test_synthetic_store_identifies_its_samples(tmp_path: Path, sorted_classes: bool) -> None:
    from lmdbstore.store.reader import StoreReader

    ooc_runs.make_store(tmp_path / "s", 1000, sorted_classes=sorted_classes)
    with StoreReader(tmp_path / "s") as r:
        idx = np.array([999, 0, 500, 17])
        np.testing.assert_array_equal(r.read_batch(idx)[:, 0, 0], idx.astype(np.float32))
        labels = r.labels()
    np.testing.assert_array_equal(labels, ooc_runs.labels_for(0, 1000, 1000, sorted_classes))
    if sorted_classes:
        assert np.all(np.diff(labels.astype(int)) >= 0) and len(np.unique(labels)) == 5


def test_bad_inflight_exits_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ooc.main(["--inflight", "0"])
    assert exc.value.code == 2 and "--inflight" in capsys.readouterr().err
