"""scripts/bench/tfrecord.py runs end to end (--quick): shards in, a store equal to them out, TensorFlow hidden."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO as ROOT


def test_quick_run_ingests_a_store_equal_to_the_shards(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "tfrecord.py"), "--quick", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["equal"] is True and report["tensorflow_hidden"] is True
    assert (report["samples"], report["shards"]) == (3000, 4) and report["ingest_samples_per_s"] > 0
    assert list(tmp_path.iterdir()) == []  # its files removed
