"""scripts/bench/parallel.py runs end to end (--quick) and reports every measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO as ROOT


def test_quick_run_reports_every_measurement(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench" / "parallel.py"),
            "--quick",
            "--workers",
            "1,2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for row in ("workers=1", "workers=2", "np.save + fsync", "single writer as write_parallel drives it", "pipe"):
        assert row in proc.stdout, row
    data = json.loads((tmp_path / "bench_parallel.json").read_text())
    assert [r["samples"] for r in data["rows"]] == [6 * 4096, 6 * 4096]
    assert data["writer"]["writer_mb_s"] > 0 and data["writer"]["npsave_mb_s"] > 0
    assert (tmp_path / "bench_parallel.md").read_text().startswith("machine:")
