"""Smoke tests of ``scripts/bench/loader.py``: a tiny run works end to end and writes sane numbers.

Speed is never asserted (the machine is shared); only that every configured measurement exists, its rates
are positive and finite, and the trainer's metrics are in range.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from conftest import build_store, load_script, make_data

loader = load_script("loader")
loader_report = load_script("loader_report")
loader_runs = load_script("loader_runs")


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_quick_run_writes_every_measurement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    assert loader.main(["--quick", "--n", "3000", "--batch", "256", "--out", str(out), "--workdir", str(work)]) == 0

    payload = json.loads((out / "bench_loader.json").read_text())
    rows = payload["rows"]
    modes = set(loader_runs.MODES)
    assert {(r["kind"], r["label"].split(",")[-1].strip()) for r in rows if r["kind"] == "memmap"} == {
        ("memmap", "unsorted indices"),
        ("memmap", "sorted indices (baseline)"),
    }
    assert {r["mode"] for r in rows if r["kind"] == "read_batch"} == modes
    assert {(r["mode"], r["workers"]) for r in rows if r["kind"] == "loader"} == {(m, w) for m in modes for w in (0, 1)}
    for r in rows:
        assert _positive(r["rate"]) and _positive(r["mean_rate"]) and _positive(r["per_core"]), r
        assert _positive(r["ratio"]), r
        assert r["rate"] >= r["mean_rate"] * 0.999, r  # best window is never below the mean
        if r["kind"] == "loader":
            assert r["cores"] == 1 and r["goal"] == loader_report.GOALS[r["mode"]] and isinstance(r["met"], bool)
            assert r["met"] == (r["ratio"] >= r["goal"])
            if loader_runs.psutil is not None:
                assert _positive(r["cpu_rate"]), r
    baseline = next(r for r in rows if r["label"].endswith("(baseline)"))
    assert baseline["ratio"] == pytest.approx(1.0)

    train = payload["train"]
    assert [t["workers"] for t in train] == [1] and train[0]["steps"] == 2
    assert 0.0 <= train[0]["data_wait_share"] <= 1.0
    assert _positive(train[0]["samples_per_s"]) and _positive(train[0]["step_time_ms"])
    assert len(payload["goals"]) == len(modes) + 1

    with open(out / "bench_loader.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    report = (out / "bench_loader.md").read_text()
    assert report.startswith("Machine: ") and "| make_loader (LmdbBatchDataset) | block4 | 1 |" in report
    assert "Goals:" in report and "data wait" in report
    assert report in capsys.readouterr().out  # the table is printed too
    assert not (work / "store").exists() and not (work / "samples.npy").exists()  # data removed without --keep


def test_reuses_a_given_store_and_exports_its_npy(tmp_path: Path) -> None:
    x, y = make_data(700, seed=4)
    store = build_store(tmp_path / "store", x, y)
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["--quick", "--store", str(store), "--modes", "block1", "--workers", "0", "--train-workers", ""]
    assert loader.main([*args, "--batch", "128", "--out", str(out), "--workdir", str(work), "--keep"]) == 0
    payload = json.loads((out / "bench_loader.json").read_text())
    assert payload["args"]["n"] == 700 and payload["train"] == []
    assert {(r["kind"], r["mode"]) for r in payload["rows"]} == {
        ("memmap", "random"),
        ("read_batch", "block1"),
        ("loader", "block1"),
    }
    import numpy as np

    np.testing.assert_array_equal(np.load(work / "samples.npy"), x)  # the baseline reads the same samples
    assert store.exists()  # a given store is never removed


@pytest.mark.parametrize(
    "argv",
    [["--workers", "one"], ["--modes", "shuffled"], ["--batch", "0"], ["--npy", "x.npy"], ["--workers", "-1"]],
)
def test_bad_arguments_exit_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        loader.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
