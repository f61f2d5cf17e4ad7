"""The storage and scaling benchmarks' own checks: every format adapter round-trips bit for bit, and a tiny
run works.

Speed is never asserted here (the machine is shared); only that the numbers exist and are sane.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

N = 2000


common = load_script("common")
machine = load_script("machine")
other_formats = load_script("other_formats")
scaling_bench = load_script("scaling")  # not `scaling`: the test below names its rows so
storage = load_script("storage")


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    return common.make_data(N, (25, 25), 5, seed=3)


@pytest.mark.parametrize("name", list(other_formats.FORMATS))
def test_format_round_trips(name: str, data: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    x, y = data
    fmt = other_formats.make_format(name, tmp_path)
    stats = fmt.build(x, y)
    assert stats.n == N and stats.seconds > 0
    assert stats.disk_bytes >= x.nbytes  # at least the raw payload is on disk
    rng = np.random.default_rng(5)
    idx = rng.permutation(N)[:300]
    idx = np.concatenate([idx, idx[:5]])  # repeats are allowed too
    for mode in fmt.modes:
        got_x, got_y = fmt.read_xy(idx, mode)
        assert got_x.dtype == np.float32 and got_x.shape == (len(idx), 25, 25), mode
        assert got_x.tobytes() == x[idx].tobytes(), f"{name} {mode}: samples differ"
        np.testing.assert_array_equal(np.asarray(got_y, np.int64), y[idx].astype(np.int64))
    fmt.close()
    fmt.remove()
    assert not fmt.dir.exists()


def test_lmdbstore_block_batches_cover_every_sample(data: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    x, y = data
    fmt = other_formats.make_format("lmdbstore", tmp_path)
    fmt.build(x, y)
    spv = fmt.spv()
    batches = storage.block_batches(N, spv, 512, 4, -(-N // 512), seed=0)
    seen = np.concatenate(batches)
    np.testing.assert_array_equal(np.sort(seen), np.arange(N))
    got_x, _ = fmt.read_xy(batches[1], "read_batch")
    assert got_x.tobytes() == x[batches[1]].tobytes()
    fmt.close()


def test_loaders_deliver_the_requested_batches(data: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    """The 2-worker DataLoader path returns exactly the samples of each batch (baseline and lmdbstore)."""
    x, y = data
    for name in ("sqlite", "lmdbstore"):
        fmt = other_formats.make_format(name, tmp_path)
        fmt.build(x, y)
        batches = common.random_batches(N, 256, 4, seed=1)
        if name == "lmdbstore":
            # lmdbstore's loader draws its own batches with EpochBatchSampler: check content against labels
            loader = fmt.loader(batches, "read_batch", "random", workers=2)
            # find each sample in the source through its first two values (random normals: unique)
            pos = {x[i, 0, :2].tobytes(): i for i in range(N)}
            n_batches = 0
            for xb, yb in loader:
                flat = xb.numpy().reshape(len(xb), 25, 25)
                src = np.array([pos[flat[j, 0, :2].tobytes()] for j in range(len(flat))])
                assert flat.tobytes() == x[src].tobytes()
                np.testing.assert_array_equal(yb.numpy(), y[src].astype(np.int64))
                n_batches += 1
            assert n_batches == len(batches)
        else:
            loader = fmt.loader(batches, "IN batch", "random", workers=2)
            got = list(loader)
            assert len(got) == len(batches)
            for b, (xb, yb) in zip(batches, got, strict=True):
                assert xb.numpy().tobytes() == x[b].tobytes()
                np.testing.assert_array_equal(yb.numpy(), y[b].astype(np.int64))
        fmt.remove()


def test_cold_read_drops_pages(data: tuple[np.ndarray, np.ndarray], tmp_path: Path) -> None:
    x, y = data
    fmt = other_formats.make_format("memmap", tmp_path)
    fmt.build(x, y)
    batches = common.random_batches(N, 256, 2, seed=2)
    rate, _before, after = machine.time_cold(fmt, lambda b: fmt.read_xy(b, "fancy"), batches, max_time=5.0)
    assert rate > 0
    if after is not None:  # mincore works here: the drop must be visible (or reported) as a share
        assert 0.0 <= after <= 1.0
    fmt.remove()


def test_quick_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    result = storage.main(
        ["--quick", "--n", "3000", "--npy-n", "500", "--batch", "512", "--min-time", "0.05", "--out", str(out)]
    )
    scaling_args = ["--quick", "--n", "3000", "--scaling-sizes", "1000,3000", "--probe-batches", "2", "--batch", "512"]
    scaling_bench.main([*scaling_args, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "Machine:" in printed and "Goals" in printed and "Scaling" in printed
    with open(out / "bench_results.csv") as f:
        rows = list(csv.DictReader(f))
    expected = {
        (name, mode, order) for name, cls in other_formats.FORMATS.items() for mode in cls.modes for order in cls.orders
    }
    assert {(r["format"], r["mode"], r["order"]) for r in rows} == expected
    for r in rows:
        assert float(r["read_1p"]) > 0 and float(r["ingest_sps"]) > 0
        assert float(r["disk_vs_raw"]) >= 0.99
        assert int(r["n"]) == (500 if r["format"] == "npy_files" else 3000)
    memmap = next(r for r in rows if r["format"] == "memmap")
    assert float(memmap["read_1p_vs_memmap"]) == pytest.approx(1.0)
    with open(out / "bench_scaling.csv") as f:
        scaling = list(csv.DictReader(f))
    assert [int(r["n"]) for r in scaling] == [1000, 3000]
    for r in scaling:
        assert int(r["depth"]) >= 1 and float(r["peak_rss_mib"]) > 0
        assert float(r["read_sps"]) > 0 and float(r["memmap_read_sps"]) > 0  # the memmap reference ran too
        assert int(r["samples_read"]) == 3 * 512  # --probe-batches 2, plus the warm-up batch
    saved = json.loads((out / "bench_results.json").read_text())
    assert saved["machine"]["cores"] >= 1 and len(saved["goals"]) == len(result["goals"])
    assert not (out / "data").exists()  # data files cleaned up without --keep


def test_window_rate_ignores_a_stalled_batch() -> None:
    # three batches of 10 samples, one stalled for 100 s by another process: the median keeps 10/s
    assert common.window_rate([10, 10, 10], [1.0, 1.0, 100.0]) == pytest.approx(10.0)
    assert common.window_rate([10, 10, 10, 10], [1.0, 1.0, 1.0, 3.0], window=2) == pytest.approx(7.5)


def test_bad_format_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="formats"):
        storage.main(["--quick", "--formats", "memmap,parquet"])
