"""`ingest(..., workers=N)` and `lmdbstore ingest --workers N`: same store and ledger as the serial ingest,
validation before writing (file and row named, store unchanged), resume across serial and parallel runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, REPO, build_store, make_data, snapshot_store
from lmdbstore_cli.main import app
from typer.testing import CliRunner

from lmdbstore import ValidationError, open_reader, open_writer
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources


def _sources(tmp_path: Path) -> list[Path]:
    """Three sources of different kinds and lengths: npz with names, npy (label c), npz with ids."""
    x1, y1 = make_data(700, 1)
    x2, _ = make_data(333, 2)
    x3, y3 = make_data(901, 3)
    np.savez(tmp_path / "a.npz", x=x1, y=np.asarray(CLASSES)[y1])
    np.save(tmp_path / "b.npy", x2)
    np.savez(tmp_path / "c.npz", x=x3, y=y3)
    return [tmp_path / "a.npz", tmp_path / "b.npy", tmp_path / "c.npz"]


def _open(paths: list[Path]):  # type: ignore[no-untyped-def]
    return [s for p in paths for s in open_sources([p], label="c" if p.suffix == ".npy" else None)]


def _everything(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open_reader(path) as r:
        return r.read_range(0, len(r)), r.labels()


def test_workers_give_the_serial_store_and_ledger(tmp_path: Path) -> None:
    paths = _sources(tmp_path)
    serial = ingest(tmp_path / "serial", _open(paths), classes=CLASSES, batch=128)
    par = ingest(tmp_path / "par", _open(paths), classes=CLASSES, batch=128, workers=2)
    assert (par.added, par.total, par.created) == (serial.added, serial.total, True) == (1934, 1934, True)
    assert [(s.name, s.written, s.skipped) for s in par.sources] == [
        (s.name, s.written, s.skipped) for s in serial.sources
    ]
    xs, ys = _everything(tmp_path / "serial")
    xp, yp = _everything(tmp_path / "par")
    np.testing.assert_array_equal(xp, xs)
    np.testing.assert_array_equal(yp, ys)
    with open_writer(tmp_path / "serial") as w:
        ledger_serial = w.progress_entries()
    with open_writer(tmp_path / "par") as w:
        assert w.progress_entries() == ledger_serial
    # rerunning with workers finds everything done
    again = ingest(tmp_path / "par", _open(paths), workers=2)
    assert again.added == 0 and [s.skipped for s in again.sources] == [700, 333, 901]


def test_a_bad_row_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    store = build_store(tmp_path / "s", *make_data(50, 9))
    before = snapshot_store(store)
    good = _sources(tmp_path)
    x, y = make_data(600, 5)
    x[517, 2, 2] = np.inf
    np.savez(tmp_path / "bad.npz", x=x, y=y)
    with pytest.raises(ValidationError) as err:
        ingest(store, _open([*good, tmp_path / "bad.npz"]), batch=100, workers=2)
    assert err.value.path == str(tmp_path / "bad.npz") and err.value.key == 517
    assert "non-finite" in str(err.value)
    assert snapshot_store(store) == before


def test_parallel_ingest_resumes_a_serial_one(tmp_path: Path) -> None:
    paths = _sources(tmp_path)
    store = tmp_path / "s"
    ingest(store, _open(paths[:1]), classes=CLASSES)  # an earlier run that got through the first source
    rep = ingest(store, _open(paths), batch=200, workers=2)
    assert [s.skipped for s in rep.sources] == [700, 0, 0] and rep.added == 1234
    x, y = _everything(store)
    ingest(tmp_path / "ref", _open(paths), classes=CLASSES)
    xr, yr = _everything(tmp_path / "ref")
    np.testing.assert_array_equal(x, xr)
    np.testing.assert_array_equal(y, yr)


def test_cli_workers(tmp_path: Path) -> None:
    paths = _sources(tmp_path)[::2]  # the two npz files
    result = CliRunner().invoke(
        app, ["ingest", str(tmp_path / "s"), *map(str, paths), "--workers", "2", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "+1,601 samples" in result.output
    x, _ = _everything(tmp_path / "s")
    np.testing.assert_array_equal(x, np.concatenate([make_data(700, 1)[0], make_data(901, 3)[0]]))
    bad = CliRunner().invoke(app, ["ingest", str(tmp_path / "t"), str(paths[0]), "--workers", "-1"])
    assert bad.exit_code != 0


def test_cli_workers_as_a_subprocess_reports_a_bad_source_in_one_line(tmp_path: Path) -> None:
    x, y = make_data(300, 4)
    y[123] = 17
    np.savez(tmp_path / "bad.npz", x=x, y=y)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmdbstore",
            "ingest",
            str(tmp_path / "s"),
            str(tmp_path / "bad.npz"),
            "--workers",
            "2",
            "--classes",
            ",".join(CLASSES),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "bad.npz" in proc.stderr and "(at 123)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


INGEST_SCRIPT = """
import sys, time
from lmdbstore import WriterConfig
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources

class Bar:  # says each committed chunk of the writing pass on stdout, and paces it so a kill lands mid-pass
    def __init__(self, desc, total):
        self.writing = desc.startswith("ingest")
    def update(self, n):
        if self.writing:
            print("ROWS", n, flush=True)
            time.sleep(0.02)
    def close(self):
        pass

rep = ingest(sys.argv[1], open_sources(sys.argv[2:]), classes=list("abcde"), batch=200, workers=2,
             config=WriterConfig(commit_bytes=1, sync=False), progress=Bar)
print("DONE", rep.total, flush=True)
"""


@pytest.mark.slow
def test_killed_parallel_ingest_resumes_to_exactly_the_sources(tmp_path: Path) -> None:
    paths = []
    for i in range(4):
        x, y = make_data(3000, 20 + i)
        np.savez(tmp_path / f"s{i}.npz", x=x, y=y)
        paths.append(tmp_path / f"s{i}.npz")
    ingest(tmp_path / "ref", _open(paths), classes=CLASSES)
    ref_x, ref_y = _everything(tmp_path / "ref")
    store = tmp_path / "s"
    cmd = [sys.executable, "-c", INGEST_SCRIPT, str(store), *map(str, paths)]
    rng = np.random.default_rng(5)
    counts = []
    for _ in range(3):
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
        )
        assert proc.stdout is not None
        wait_for = int(rng.integers(1, 15))  # chunks of 200 rows committed by this run before the kill
        for line in proc.stdout:
            wait_for -= line.startswith("ROWS")
            if wait_for == 0 or line.startswith("DONE"):
                break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        if store.exists():  # whole chunks in source order, as the per-source ledger says
            with open_writer(store) as w:
                done = sum(e["done"] for e in w.progress_entries().values())
            counts.append(done)
            x, y = _everything(store)
            assert len(x) == done
            np.testing.assert_array_equal(x, ref_x[:done])
            np.testing.assert_array_equal(y, ref_y[:done])
    assert len(counts) == 3 and all(0 < c < len(ref_x) for c in counts) and counts == sorted(counts), (
        counts
    )  # kills mid-pass
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == ["DONE", str(len(ref_x))]
    x, y = _everything(store)
    np.testing.assert_array_equal(x, ref_x)
    np.testing.assert_array_equal(y, ref_y)
