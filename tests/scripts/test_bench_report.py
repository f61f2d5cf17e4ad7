"""scripts/bench/report.py: docs/benchmarks.md and the README's headline table come from the results, and every
figure of the README's headline table is the one docs/benchmarks.md shows."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO))
from scripts.bench import report
from scripts.bench.driver import Options, run
from scripts.bench.spec import Baseline, Benchmark, Measure, Row, at_least
from scripts.bench.suites import SUITES

HEADLINE_ROW = re.compile(r"^\| \[(\w+): (.+?)\]\(docs/benchmarks\.md#(\w+)\) \| (.*) \|$")


def doc_rows(doc: str) -> dict[tuple[str, str], list[str]]:
    """(benchmark, row) -> the cells after the row's name, for every named row of every section's table."""
    out: dict[tuple[str, str], list[str]] = {}
    section = ""
    for line in doc.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| ") and section:
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if cells[0]:
                out[section, cells[0]] = cells[1:]
    return out


def test_every_figure_of_the_readme_headline_is_the_one_the_benchmarks_doc_shows() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index(report.BEGIN) : readme.index(report.END)]
    rows = [m.groups() for m in map(HEADLINE_ROW.match, block.splitlines()) if m]
    assert len(rows) >= 10, "the headline table lost its rows"
    doc = doc_rows((REPO / "docs" / "benchmarks.md").read_text())
    for bench, name, anchor, cells in rows:
        assert anchor == bench and (bench, name) in doc, f"{bench}: {name} is not in docs/benchmarks.md"
        assert [c.strip() for c in cells.split(" | ")] == doc[bench, name], f"{bench}: {name} differs"


def test_the_benchmarks_doc_has_every_benchmark_within_500_lines() -> None:
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(doc.splitlines()) <= 500
    assert [line[3:] for line in doc.splitlines() if line.startswith("## ")] == list(SUITES)
    for line in doc.splitlines():  # each measured section names its command, commit and date
        if line.startswith("`python -m scripts.bench "):
            assert " · commit " in line and " UTC · " in line, line


def test_the_documents_are_generated_from_the_results(tmp_path: Path) -> None:
    rate = Measure("the rate", lambda ctx: {"rate": 3000.0}, uses=())
    limit = Measure("the limit", lambda ctx: {"rate": 2000.0}, uses=())
    toy = Benchmark(
        "readpath",
        "a title",
        "What it does.",
        (Row("cold random", rate, baselines=(Baseline(limit),), goal=at_least(0.8)),),
    )
    res = run(toy, Options(out=tmp_path, command="python -m scripts.bench readpath", store_dir=tmp_path / "s"))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Headline figures\n\n{report.BEGIN}\nold figures\n{report.END}\n\n## Next\n")
    report.write(tmp_path, tmp_path / "benchmarks.md", readme, {"readpath": toy, "feed": SUITES["feed"]})
    doc = (tmp_path / "benchmarks.md").read_text()
    assert f"`python -m scripts.bench readpath` · commit {res['header']['commit']} · {res['header']['date']}" in doc
    assert "| cold random | 3k/s | the limit: 2k/s | 1.5x | >= 0.8x: met |" in doc
    assert "Not measured yet: `python -m scripts.bench feed`." in doc and report.QUICK not in doc
    text = readme.read_text()
    assert "old figures" not in text and text.endswith(f"{report.END}\n\n## Next\n")
    assert (
        "| [readpath: cold random](docs/benchmarks.md#readpath) | 3k/s | the limit: 2k/s | 1.5x | >= 0.8x: met |"
        in text
    )
    res["quick"] = True
    (tmp_path / "readpath.json").write_text(json.dumps(res))
    report.write(tmp_path, tmp_path / "benchmarks.md", readme, {"readpath": toy})
    assert report.QUICK in readme.read_text() and report.QUICK in (tmp_path / "benchmarks.md").read_text()
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="headline markers"):
        report.write(tmp_path, tmp_path / "benchmarks.md", readme, {"readpath": toy})
