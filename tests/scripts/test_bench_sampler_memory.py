"""scripts/bench/sampler_memory.py runs end to end (small, two orders) and reports each with its goal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO as ROOT


def test_small_run_reports_every_order(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "bench" / "sampler_memory.py"
    argv = [
        sys.executable,
        str(script),
        "--samples",
        "300000",
        "--quick",
        "--orders",
        "block,window",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "bench_sampler_memory.json").read_text())
    assert [r["order"] for r in data["rows"]] == ["block", "window"]
    for r in data["rows"]:
        assert r["samples"] == 300_000 and r["steady_mib"] > 0 and r["peak_mib"] >= r["steady_mib"] - 1
        assert r["bytes_per_sample"] > 8  # at least the split's indices
        assert f"{r['order']}: main-process peak / steady RSS" in proc.stdout
    bad = subprocess.run([sys.executable, str(script), "--orders", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--orders" in bad.stderr
