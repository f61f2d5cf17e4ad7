"""scripts/bench/suites.py: the benchmarks that are cheap at a tiny size run end to end through the driver, every
row measured against its baselines, with its goal judged (the others -- frameworks, ingest, demo, scale, peers, gpu
-- start TensorFlow, training runs or clusters, or need what CI lacks: `python -m scripts.bench NAME --quick`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO))
from scripts.bench.driver import Options, run
from scripts.bench.suites import SUITES


@pytest.mark.parametrize(
    ("name", "samples", "rows"),
    [
        ("readpath", 8192, None),
        ("sets", 8192, None),
        ("verify", 8192, None),
        ("formats", 2048, None),
        ("memory", 20_000, slice(2, 3)),  # the window sampler's row: one fresh interpreter, not four
    ],
)
def test_a_tiny_run_measures_every_row(tmp_path: Path, name: str, samples: int, rows: slice | None) -> None:
    bench = SUITES[name] if rows is None else replace(SUITES[name], rows=SUITES[name].rows[rows])
    res = run(
        bench,
        Options(
            out=tmp_path,
            quick=True,
            seconds=0.05,
            samples=samples,
            store_dir=tmp_path / "s",
            command=f"python -m scripts.bench {name} --quick",
        ),
    )
    assert res["status"] == "complete" and [r["name"] for r in res["rows"]] == [r.name for r in bench.rows]
    for row, decl in zip(res["rows"], bench.rows, strict=True):
        assert row["figure"]["median"] > 0, row["name"]
        assert [b["ratio"]["median"] > 0 for b in row["baselines"]] == [True] * len(decl.baselines), row["name"]
        assert row.get("met") in ((True, False) if decl.goal else (None,)), row["name"]
    assert (tmp_path / f"{name}.md").read_text().count("\n| ") >= len(bench.rows) + 1
    assert sorted(p.name for p in (tmp_path / "s").iterdir() if p.name.startswith("scratch")) == []
