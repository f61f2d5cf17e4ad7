"""Pictures: sample grids, run plots and stats plots are real PNGs of the documented size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import StoreInfo

pytest.importorskip("matplotlib")
from PIL import Image

from lmdbstore import LmdbStoreError
from lmdbstore.tools.viz import load_metrics, plot_runs, plot_stats, show_samples


def _png(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.load()
        arr = np.asarray(im)
    assert arr.std() > 0  # something was drawn
    return im.size


def _metrics(run: Path, epochs: int, scale: float = 1.0) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "w") as f:
        for e in range(epochs):
            f.write(
                json.dumps(
                    {
                        "epoch": e,
                        "train_loss": scale / (e + 1),
                        "val_loss": scale / (e + 1.5),
                        "val_accuracy": 0.5 + 0.1 * e,
                        "samples_per_s": 1000.0 + e,
                    }
                )
                + "\n"
            )
    return run


def test_show_grid_size_and_indices(small_store: StoreInfo, tmp_path: Path) -> None:
    pic = show_samples(small_store.path, tmp_path / "s.png")
    assert (pic.width, pic.height) == (round((8 * 1.3 + 1.2) * 100), round((5 * 1.3 + 0.7) * 100))
    assert _png(tmp_path / "s.png") == (pic.width, pic.height)
    pic = show_samples(small_store.path, tmp_path / "i.png", indices=[3, 1999, 0], dpi=50)
    rows = len(set(small_store.y[[3, 1999, 0]].tolist()))
    cols = max(np.bincount(small_store.y[[3, 1999, 0]]))
    assert _png(tmp_path / "i.png") == (round((cols * 1.3 + 1.2) * 50), round((rows * 1.3 + 0.7) * 50))


def test_show_refuses_bad_arguments(small_store: StoreInfo, tmp_path: Path) -> None:
    with pytest.raises(IndexError, match="2000"):
        show_samples(small_store.path, tmp_path / "x.png", indices=[2000])
    with pytest.raises(ValueError, match="per_class"):
        show_samples(small_store.path, tmp_path / "x.png", per_class=0)
    with pytest.raises(LmdbStoreError, match="output directory does not exist"):
        show_samples(small_store.path, tmp_path / "no" / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_runs_overlays_and_keeps_the_last_record_per_epoch(tmp_path: Path) -> None:
    a = _metrics(tmp_path / "a", 3)
    b = _metrics(tmp_path / "b", 5, scale=2.0)
    with open(a / "metrics.jsonl", "a") as f:  # a restarted epoch 2 replaces the first record of it
        f.write(json.dumps({"epoch": 2, "train_loss": 0.01, "val_accuracy": 0.99}) + "\n")
    recs = load_metrics(a)
    assert [r["epoch"] for r in recs] == [0, 1, 2] and recs[-1]["train_loss"] == 0.01
    pic = plot_runs([a, b / "metrics.jsonl"], tmp_path / "run.png")
    assert _png(tmp_path / "run.png") == (pic.width, pic.height) == (1500, 420)


def test_plot_runs_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(LmdbStoreError, match="metrics"):
        plot_runs([tmp_path / "missing"], tmp_path / "x.png")
    run = _metrics(tmp_path / "r", 1)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(LmdbStoreError, match="line 2"):
        plot_runs([run], tmp_path / "x.png")
    with pytest.raises(ValueError, match="runs"):
        plot_runs([], tmp_path / "x.png")


def test_plot_stats(small_store: StoreInfo, tmp_path: Path) -> None:
    pic = plot_stats(small_store.path, tmp_path / "st.png", sample=500, dpi=80)
    assert _png(tmp_path / "st.png") == (pic.width, pic.height) == (960, 336)


def test_missing_matplotlib_is_one_line_naming_the_extra(small_store: StoreInfo, tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # makes `import matplotlib` fail as if not installed
        "from lmdbstore_cli.main import main; sys.argv = ['lmdbstore', 'show', sys.argv[1], '-o', sys.argv[2]]; main()"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(small_store.path), str(tmp_path / "s.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    assert p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr
    assert "matplotlib" in p.stderr and "lmdbstore[viz]" in p.stderr
    assert not (tmp_path / "s.png").exists()
