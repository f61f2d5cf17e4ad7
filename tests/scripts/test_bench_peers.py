"""scripts/bench/peers.py: the table exists with the baseline rows; each peer round-trips when installed.

The peer libraries are an optional extra that CI does not install: their tests skip when a library is
missing.  Speed is never asserted (the machine is shared); only that the numbers exist and are sane.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

bp = load_script("peers")
common = load_script("common")
peer_formats = load_script("peer_formats")
N = 4096 + 904  # one full batch and a partial one


def test_baseline_rows_and_table(tmp_path: Path) -> None:
    args = ["-n", str(N), "--peers", "memmap,lmdbstore", "--min-time", "0.05", "--cold-time", "0.05"]
    results = bp.main([*args, "--dir", str(tmp_path / "d"), "--out", str(tmp_path / "o")])
    assert [r.name for r in results] == ["memmap", "lmdbstore"]
    for r in results:
        assert r.error is None, r.error
        assert r.ingest_sps > 0 and r.warm_random_sps > 0 and r.epoch_sps > 0 and r.cold_random_sps > 0
        assert 2500 <= r.bytes_per_sample < 2500 * 1.2
    table = (tmp_path / "o" / "peers.md").read_text()
    assert "| lmdbstore |" in table and "| memmap |" in table and "(lmdbstore / it)" in table
    assert not (tmp_path / "d" / "lmdbstore").exists()  # scratch data removed without --keep


def test_unknown_peer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bp.main(["-n", str(N), "--peers", "nope", "--dir", str(tmp_path)])


@pytest.mark.parametrize(
    ("name", "module"), [("mds", "streaming"), ("litdata", "litdata"), ("webdataset", "webdataset")]
)
def test_peer_round_trip(name: str, module: str, tmp_path: Path) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not installed (optional 'peers' extra)")
    x, y = common.make_data(N, (25, 25), 5, seed=1)
    peer = peer_formats.PEER_CLASSES[name](tmp_path, N)
    peer.prepare()
    peer.build(x, y)
    try:
        if peer.random_access:
            peer.open()
            idx = np.array([N - 1, 0, 4321, 17])
            gx, gy = peer.read(idx)
            assert np.array_equal(gx, x[idx]) and np.array_equal(gy, y[idx])
            peer.close()
        seen = 0
        for xb, yb in peer.loader(2048, 0):
            assert tuple(xb.shape[1:]) == (25, 25) and len(yb) == len(xb)
            seen += len(xb)
        assert seen == N
    finally:
        peer.close()
