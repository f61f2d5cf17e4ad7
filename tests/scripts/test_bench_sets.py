"""scripts/bench/sets.py runs end to end (--quick) and reports every row with its goal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO as ROOT


def test_quick_run_reports_every_row(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "sets.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for row in ("warm random, set grouped by store", "warm block", "disk limit", "cold random", ">= 0.9x"):
        assert row in proc.stdout, row
    data = json.loads((tmp_path / "bench_sets.json").read_text())
    assert data["stores"] == 4 and data["samples"] == 40_000
    assert data["rows"]["cold random"]["set"] > 0 and data["rows"]["cold random"]["limit"] > 0
