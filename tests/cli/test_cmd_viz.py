"""cli/cmd_viz.py: ``show`` and ``plot``, ``stats --plot`` and ``train --plot``: the pictures' sizes, a plot of
two runs, bad arguments as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import (
    StoreInfo,
    one_error_line,
    run_cli,
)


def test_show_plot_and_stats_plot(small_store: StoreInfo, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    r = run_cli("show", small_store.path, "-o", tmp_path / "s.png", "--per-class", "4", "--seed", "3")
    assert r.exit_code == 0 and "s.png (640x720 px)" in r.stdout, r.output
    with Image.open(tmp_path / "s.png") as im:
        assert im.size == (640, 720)
    r = run_cli("show", small_store.path, "-o", tmp_path / "t.png", "--indices", "1,2,x")
    assert r.exit_code == 1 and "comma-separated integers" in one_error_line(r)
    r = run_cli("stats", small_store.path, "--plot", tmp_path / "st.png")
    assert r.exit_code == 0 and "wrote" in r.stdout
    with Image.open(tmp_path / "st.png") as im:
        assert im.size == (1200, 420)
    r = run_cli("plot", tmp_path / "norun", "-o", tmp_path / "p.png")
    assert r.exit_code == 1 and "metrics" in one_error_line(r)


def test_train_plot_then_plot_two_runs(small_store: StoreInfo, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    for name in ("r1", "r2"):
        r = run_cli("train", small_store.path, "--epochs", "2", "--batch", "256", "--workers", "0", "--width", "4",
                    "--device", "cpu", "--out", tmp_path / name, "--plot", "--no-progress")  # fmt: skip
        assert r.exit_code == 0, r.output
        with Image.open(tmp_path / name / "run.png") as im:
            assert im.size == (1500, 420)
    r = run_cli("plot", tmp_path / "r1", tmp_path / "r2", "-o", tmp_path / "both.png", "--dpi", "50")
    assert r.exit_code == 0 and "(750x210 px)" in r.stdout, r.output
    assert json.loads((tmp_path / "r2" / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 2
