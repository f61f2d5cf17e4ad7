"""scripts/bench/scale.py runs end to end at a tiny size, reports every row with its limit and goal, deletes what it
built, and refuses up front a size the disk cannot hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO as ROOT

SCRIPT = ROOT / "scripts" / "bench" / "scale.py"


@pytest.mark.slow
def test_tiny_run_reports_every_row_and_leaves_nothing(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), "--samples", "20000", "--quick", "--workdir", str(work), "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads((out / "bench_scale.json").read_text())["rows"]}
    for name in (
        "disk: sequential read (dd, pages dropped)",
        "verify, every core (cold)",
        "cold random: samples/s",
        "cold window: MB/s",
        "  first batch, cold window",
        "set of 4 stores, warm random: vs one store",
        "set of 4 stores, cold window: vs one store",
        "train: data wait",
        "train: main process private RSS, peak / steady",
    ):
        assert name in rows, name
    assert rows["verify, every core (cold)"]["ratio"] > 0 and rows["cold window: MB/s"]["goal"] == ">= 0.8"
    killed = [r for n, r in rows.items() if n.startswith("kill at step")]
    assert killed and killed[0]["figure"] == "yes"  # a killed run, resumed inside its epoch, ends bit-identical
    assert any(n.startswith("cold auto") for n in rows)
    assert "| verify, every core (cold) |" in (out / "bench_scale.md").read_text()
    assert list(work.iterdir()) == []  # the stores, runs and probe file are gone


def test_a_size_the_disk_cannot_hold_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--samples", str(10**13), "--workdir", str(tmp_path), "--out", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "GiB free" in proc.stderr
    assert list(tmp_path.iterdir()) == []
