"""scripts/bench/parallel.py runs end to end (--quick) and reports every measurement."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO as ROOT


def test_quick_run_reports_every_measurement(tmp_path: Path) -> None:
    dask = importlib.util.find_spec("distributed") is not None  # in the [dev] extra
    runs = ["1", "2", *(["dask2"] if dask else [])]
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench" / "parallel.py"),
            "--quick",
            "--workers",
            ",".join(runs),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = ["workers=1", "workers=2", "np.save + fsync", "single writer as write_parallel drives it", "pipe"]
    for row in [*rows, *(["Dask LocalCluster(2)"] if dask else [])]:
        assert row in proc.stdout, row
    data = json.loads((tmp_path / "bench_parallel.json").read_text())
    assert [r["samples"] for r in data["rows"]] == [6 * 4096] * len(runs)
    assert [r["run"] for r in data["rows"]] == runs
    (cost,) = data["sweep"]  # --quick: one task cost of 10 ms, one round
    assert cost["cost_ms"] == 10 and cost["tasks"] == 6 and cost["produce_ms"] > 0
    for r in data["rows"]:  # CPU of the writer's thread and of the workers (local: reaped; Dask: its processes)
        assert r["writer_thread_ms"] > 0 and r["workers_ms"] > 0, r
    assert data["writer"]["writer_mb_s"] > 0 and data["writer"]["npsave_mb_s"] > 0
    assert (tmp_path / "bench_parallel.md").read_text().startswith("machine:")
