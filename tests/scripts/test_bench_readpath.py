"""scripts/bench/readpath.py runs end to end (--quick) and reports every row with its goal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO as ROOT


def test_quick_run_reports_every_row(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "readpath.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for row in ("cold random vs pread 2.5 KB x64", "cold window: first batch", "warm block vs memmap", "I/O threads"):
        assert row in proc.stdout, row
    data = json.loads((tmp_path / "bench_readpath.json").read_text())
    assert data["samples"] == 40_000
    assert data["warm"]["loaded"]["pread_batches"] == 0  # every batch of the warm store was cached: none sent
    assert all(data["cold"][m]["rate"] > 0 and data["cold"][m]["before"]["sample x16"] > 0 for m in data["cold"])
