"""Smoke test of ``scripts/bench/checks.py``: a tiny run measures every row (checks on and off, baselines,
costs) on a real store and writes a sane report.  Speed is never asserted (the machine is shared)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import load_script

checks = load_script("checks")
QUICK = ["--samples", "4000", "--batch", "256", "--batches", "3", "--cold-batches", "2", "--repeats", "1"]


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_quick_run_measures_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    res = checks.main([*QUICK, "--warm-samples", "2000", "--seconds", "0.05", "--out", str(out)])
    for order in ("random", "block"):
        for variant in ("checks on", "snapshot rule off", "no lease (kernel copy)", "+ whole-value crc", "memmap"):
            assert _positive(res["warm"][f"{order} {variant}"]), (order, variant)
    assert all(_positive(v) for v in res["cold"].values()) and len(res["cold"]) == 5
    assert all(_positive(v) for v in res["disk"].values())
    assert set(res["costs"]) >= {
        "snapshot rule us (lock-free)",
        "record fingerprint check us (one pread)",
        "file-size check and lease us (map guard per batch)",
        "all headers at build us per value (cold)",
    }
    report = (out / "bench_checks.md").read_text()
    for row in ("| warm random, every check |", "| cold random header check off |", "goals:"):
        assert row in report, row
    assert report.strip() in capsys.readouterr().out
    assert json.loads((out / "bench_checks.json").read_text())["store"]["samples"] == 4000
