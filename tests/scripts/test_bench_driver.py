"""scripts/bench/driver.py: rounds, bracketing baselines, recorded measurements, goals, the results written row by
row, a failing row, the extras and the disk checked before anything is built, artifacts built once and reused from
--store-dir; and the command line (scripts/bench/__main__.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO))
from scripts.bench.__main__ import main
from scripts.bench.driver import BenchError, Options, run
from scripts.bench.spec import Baseline, Benchmark, Ctx, Data, Measure, Row, at_least, at_most


class Counter:
    """A measurement returning 10, 20, 30... (``rate``) and its call count."""

    def __init__(self, label: str, step: float = 10.0, uses: tuple[str, ...] = ()) -> None:
        self.calls, self.step = 0, step
        self.measure = Measure(label, self, uses=uses)

    def __call__(self, ctx: Ctx) -> dict[str, float]:
        self.calls += 1
        return {"rate": self.step * self.calls, "first": 0.05 * self.calls}


NO_DATA = Data(0, quick=0)


def bench(*rows: Row, needs: tuple[str, ...] = (), data: Data = NO_DATA) -> Benchmark:
    return Benchmark("toy", "a toy", "rows of counters", rows=rows, needs=needs, data=data)


def test_rounds_brackets_recorded_measurements_and_goals(tmp_path: Path) -> None:
    limit, fig, other = Counter("limit"), Counter("figure", 100.0), Counter("other", 1.0)
    b = bench(
        Row("cold", fig.measure, baselines=(Baseline(limit.measure, "bracket"),), goal=at_least(3.0)),
        Row("first", fig.measure, key="first", unit="s", goal=at_most(0.06, "figure")),
        Row("again", other.measure, baselines=(Baseline(limit.measure, "bracket"), Baseline(fig.measure, "recorded"))),
    )
    res = run(b, Options(out=tmp_path, rounds=2, store_dir=tmp_path / "s"))
    cold, first, again = res["rows"]
    # the limit right before and after each round's figure (100, 200): a round starts from the limit just taken
    assert cold["baselines"][0]["before_after"] == [[10.0, 20.0], [20.0, 30.0]]
    assert cold["figure"]["values"] == [100.0, 200.0]
    ratio = cold["baselines"][0]["ratio"]
    assert ratio["values"] == [100 / 15, 200 / 25] and ratio["median"] == pytest.approx((100 / 15 + 200 / 25) / 2)
    assert cold["met"] is True and first["met"] is False  # 7.33x >= 3; the first batch's median 0.075 s > 0.06 s
    assert first["figure"]["values"] == [0.05, 0.1] and fig.calls == 2  # read from the cold row's rounds
    # the next row's bracket starts from the last limit taken (30): the first row's figures are not measured again
    assert again["baselines"][0]["before_after"] == [[30.0, 40.0], [40.0, 50.0]] and limit.calls == 5
    assert again["baselines"][1]["value"]["values"] == [150.0, 150.0]  # the recorded figure's median, not remeasured
    assert res["status"] == "complete" and json.loads((tmp_path / "toy.json").read_text()) == res
    table = (tmp_path / "toy.md").read_text()
    assert "| cold | 150/s (100-200) | limit: 20/s | 7.33x (6.67-8) | >= 3x: met |" in table


def test_results_are_written_as_each_row_ends(tmp_path: Path) -> None:
    seen: list[Any] = []

    def killed(ctx: Ctx) -> dict[str, float]:
        seen.append(json.loads((tmp_path / "toy.json").read_text()))
        raise KeyboardInterrupt  # as a run killed in its second row

    b = bench(Row("one", Counter("one").measure), Row("two", Measure("two", killed, uses=())))
    with pytest.raises(KeyboardInterrupt):
        run(b, Options(out=tmp_path, quick=True, store_dir=tmp_path / "s"))
    assert [r["name"] for r in seen[0]["rows"]] == ["one"] and seen[0]["status"] == "running"
    kept = json.loads((tmp_path / "toy.json").read_text())
    assert kept["rows"][0]["figure"]["median"] == 10.0 and kept["status"].startswith("interrupted")


def test_a_failing_row_keeps_its_error_and_the_run_goes_on(tmp_path: Path) -> None:
    def broken(ctx: Ctx) -> dict[str, float]:
        raise ValueError("no such\nthing")

    b = bench(
        Row("bad", Measure("bad", broken, uses=()), goal=at_least(1, "figure")), Row("good", Counter("g").measure)
    )
    res = run(b, Options(out=tmp_path, quick=True, store_dir=tmp_path / "s"))
    assert res["rows"][0]["error"] == "ValueError: no such thing" and res["rows"][1]["figure"]["median"] == 10.0
    assert (
        res["status"] == "failed: bad"
        and "| bad | failed: ValueError: no such thing |" in (tmp_path / "toy.md").read_text()
    )


def test_missing_extras_and_a_full_disk_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    store = Counter("reads the store", uses=("store",)).measure
    with pytest.raises(BenchError, match="no_such_module_xyz"):
        run(
            bench(Row("r", store), needs=("no_such_module_xyz",), data=Data(5000)),
            Options(out=tmp_path / "o", store_dir=tmp_path / "s"),
        )
    with pytest.raises(BenchError, match="GiB free"):
        run(bench(Row("r", store), data=Data(10**13)), Options(out=tmp_path / "o", store_dir=tmp_path / "s"))
    assert not (tmp_path / "o").exists() and list((tmp_path / "s").iterdir()) == []


def test_artifacts_are_built_once_and_reused_from_the_store_dir(tmp_path: Path) -> None:
    import lmdbstore

    def size(ctx: Ctx) -> dict[str, float]:
        with lmdbstore.StoreReader(ctx.path("store")) as r:
            return {"rate": float(len(r))}

    b = bench(Row("n", Measure("n", size, uses=("store",))), data=Data(5000, "float16"))
    opt = Options(out=tmp_path, quick=False, rounds=1, store_dir=tmp_path / "s")
    first = run(b, opt)
    assert first["rows"][0]["figure"]["median"] == 5000 and first["built"]["store"] > 0
    data_file = tmp_path / "s" / "store-5000-float16" / "data.mdb"
    stamp = data_file.stat().st_mtime_ns
    assert run(b, opt)["rows"][0]["figure"]["median"] == 5000 and data_file.stat().st_mtime_ns == stamp  # reused
    marker = data_file.parent.with_suffix(".json")
    marker.write_text(marker.read_text().replace("float16", "float32"))  # a marker that no longer says this data
    again = run(b, opt)
    assert data_file.stat().st_mtime_ns != stamp and again["rows"][0]["figure"]["median"] == 5000  # rebuilt
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["store-5000-float16", "store-5000-float16.json"]


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0 and "readpath" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["no-such-benchmark"])
    assert exc.value.code == 2 and "unknown benchmark no-such-benchmark" in capsys.readouterr().err
    assert main(["readpath", "--dtype", "float16", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: readpath takes no --dtype\n" and not list(tmp_path.iterdir())
