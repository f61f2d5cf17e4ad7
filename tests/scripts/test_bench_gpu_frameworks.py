"""scripts/bench/gpu.py (its CPU dry run) and scripts/bench/frameworks.py (--quick) run end to end and report
every configuration."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO as ROOT


def _bench(name: str, *args: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / f"{name}.py"), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_gpu_benchmark_dry_run_on_the_cpu(tmp_path: Path) -> None:
    proc = _bench(
        "gpu", "--device", "cpu", "--quick", "-n", "2000", "--batch", "256", "--steps", "2", "--widths", "8,16",
        "--train-workers", "0,1", out=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [w["mode"] for w in result["ways"]] == ["pageable", "registered"]  # the CUDA-only ways need a GPU
    for w in result["ways"]:
        assert w["data_rate"] > 0 and w["step_rate"] > 0 and 0 <= w["data_wait"] < 1 and 0 <= w["step_wait"] < 1
    rows = result["rows"]
    assert [(r["width"], r["workers"]) for r in rows] == [(w, k) for w in (8, 16) for k in (0, 1)]
    assert all(r["samples_per_s"] > 0 and r["compute_only"] > 0 and 0 <= r["data_wait"] < 1 for r in rows)
    assert "| registered |" in proc.stdout and "x model alone" in proc.stdout


def test_gpu_benchmark_refuses_a_missing_gpu_in_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    proc = _bench("gpu", "--quick", out=tmp_path)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and "--device cpu" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow (lmdbstore[frameworks])")
def test_frameworks_benchmark_quick(tmp_path: Path) -> None:
    proc = _bench("frameworks", "--quick", out=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_frameworks.json").read_text())["rows"]
    paths = [r["path"] for r in rows]
    assert paths[:4] == ["read_batch(out=), one process", "make_loader", "tf_dataset", "keras_dataset (direct)"]
    assert all(r["rate"] > 0 and r["ratio"] > 0 for r in rows)
    assert "goals (same run, data only, warm):" in proc.stdout
