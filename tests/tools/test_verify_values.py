"""``verify``'s value pass (``lmdbstore.tools.verify_values``): the same report for any number of workers, on
healthy and damaged stores, also when stopped early; a worker killed is one line and leaves nothing.  Stores are
real, damaged through raw py-lmdb or by editing ``data.mdb``; worker processes are real.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import build_store, make_data, raw_env

from lmdbstore import StoreReader, WriterConfig, open_writer
from lmdbstore.format.checksums import checksum_int, compute_checksum, trailer_dtype
from lmdbstore.format.layout import classidx_key, encode_key
from lmdbstore.tools.verify import VerifyReport, verify_store
from lmdbstore.tools.verify_values import MIN_CHUNK, chunk_bytes, resolve_workers

SPV = 4  # 4 float16 25x25 samples = 5,004 bytes a value: overflow pages, as at scale
N = 8_003  # 10 MB in 2,001 values, the last one short: 10 chunks of 1 MiB


def _store(path: Path, checksum: str = "crc32", shape: tuple[int, ...] = (25, 25), spv: int = SPV) -> Path:
    x, y = make_data(N, 3, shape=shape, dtype=np.float16)
    return build_store(path, x, y, config=WriterConfig(samples_per_value=spv, checksum=checksum), batch=3_000)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _store(tmp_path_factory.mktemp("vw") / "store")


@pytest.fixture
def store(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(pristine, copy)
    return copy


def pairs(report: VerifyReport) -> list[tuple[str, int | None]]:
    return [(p.kind, p.index) for p in report.problems]


def damage(path: Path) -> dict[str, Any]:
    """Every kind of damage the value pass and the checks after it must find; returns what was done."""
    with StoreReader(path) as r:
        vb = r.meta.expected_value_len(0)
    with raw_env(path) as env:
        env.set_mapsize(env.info()["map_size"] + (64 << 20))
        with env.begin(write=True) as txn:
            samples = env.open_db(b"samples", txn=txn)
            for v in (3, 900, 1600):  # payload bytes changed, trailer kept: checksum problems
                key = encode_key(v * SPV)
                value = bytearray(txn.get(key, db=samples))
                value[100 + v] ^= 0x10
                txn.put(key, bytes(value), db=samples)
            txn.delete(encode_key(1000 * SPV), db=samples)  # missing
            short = txn.get(encode_key(1200 * SPV), db=samples)
            txn.put(encode_key(1200 * SPV), short[:-7], db=samples)  # wrong length
            txn.put(encode_key(1201 * SPV + 1), b"x" * vb, db=samples)  # off the grid
            txn.put(encode_key(N + 40), b"y" * 300, db=samples)  # beyond the count
            labels = env.open_db(b"labels", txn=txn)
            chunk = bytearray(txn.get(encode_key(0), db=labels))
            chunk[77] = 9  # not a class id
            txn.put(encode_key(0), bytes(chunk), db=labels)
            classidx = env.open_db(b"classidx", txn=txn)
            ids = np.frombuffer(txn.get(classidx_key(2, 0), db=classidx), "<u8").copy()
            ids[5] += 1
            txn.put(classidx_key(2, 0), ids.tobytes(), db=classidx)
    return {"checksum": [3 * SPV, 900 * SPV, 1600 * SPV], "missing": 1000 * SPV, "length": 1200 * SPV}


# ---------------------------------------------------------------------------------------------- same report


def test_healthy_store_same_report_for_1_and_2_workers(pristine: Path) -> None:
    seen: dict[int, list[int]] = {1: [], 2: []}
    one = verify_store(pristine, workers=1, progress=seen[1].append)
    two = verify_store(pristine, workers=2, progress=seen[2].append)
    assert one.ok and two.ok and one.complete
    assert one.to_dict() == two.to_dict()
    assert one.values_checked == one.checksums_checked == -(-N // SPV) and one.samples_checked == N
    assert one.labels_checked == one.class_index_entries_checked == N
    for w, calls in seen.items():  # after each chunk, never backwards, ending at every sample
        assert calls == sorted(calls) and calls[-1] == N, w
    assert len(seen[2]) > 3  # the 2-worker pass read several chunks


def test_damaged_store_same_report_for_1_and_2_workers(store: Path) -> None:
    """Damaged values, labels and class-index entries; all problems, and a stop after the first few (the
    counters then say how far the report got: up to its last problem)."""
    done = damage(store)
    one = verify_store(store, workers=1, max_problems=1000)
    two = verify_store(store, workers=2, max_problems=1000)
    assert one.to_dict() == two.to_dict()
    assert one.structure_checked and not one.ok and one.complete
    found = pairs(one)
    samples = [pr for pr in found if pr[0] in ("checksum", "missing-value", "value-length", "extra-value")]
    assert samples == sorted(samples, key=lambda pr: pr[1])  # in key order
    assert {("checksum", k) for k in done["checksum"]} <= set(found)
    assert ("missing-value", done["missing"]) in found and ("value-length", done["length"]) in found
    assert ("extra-value", 1201 * SPV + 1) in found and ("extra-value", N + 40) in found
    assert ("label-range", 77) in found and "classidx-mismatch" in {k for k, _ in found}
    assert one.values_checked == -(-N // SPV) - 1 and one.checksums_checked == one.values_checked - 1
    for limit in (2, 5):
        early = [verify_store(store, workers=w, max_problems=limit) for w in (1, 2)]
        assert early[0].to_dict() == early[1].to_dict()
        assert not early[0].complete and pairs(early[0]) == found[:limit]
        assert found[0] == ("checksum", 3 * SPV)
        assert 0 < early[0].checksums_checked < one.checksums_checked  # up to the last problem reported
        last = early[0].problems[-1].index
        assert early[0].values_checked == len([k for k in range(0, last + 1, SPV) if k != done["missing"]])


@pytest.mark.slow
def test_checksums_off_and_xxh64_and_inline_values(tmp_path: Path) -> None:
    """xxh64 trailers, values small enough to live in the leaf pages, and --no-checksums: same reports."""
    for name, checksum, shape, spv in (("x", "xxh64", (25, 25), SPV), ("inline", "crc32", (3, 3), 7)):
        path = _store(tmp_path / name, checksum, shape, spv)
        with raw_env(path) as env, env.begin(write=True) as txn:
            db = env.open_db(b"samples", txn=txn)
            value = bytearray(txn.get(encode_key(700 * spv), db=db))
            value[1] ^= 0x01
            txn.put(encode_key(700 * spv), bytes(value), db=db)
        for checksums in (True, False):
            reports = [verify_store(path, workers=w, checksums=checksums) for w in (1, 2)]
            assert reports[0].to_dict() == reports[1].to_dict()
            assert pairs(reports[0]) == ([("checksum", 700 * spv)] if checksums else [])
            assert reports[0].checksums_checked == (-(-N // spv) if checksums else 0)


def test_flipped_byte_on_disk_and_damaged_structure(store: Path) -> None:
    """A byte flipped in the file (found by the checksum) and a damaged page (found by the walk, which runs
    beside the workers): the same report for any number of workers."""
    data = bytearray((store / "data.mdb").read_bytes())
    with StoreReader(store) as r:
        target = r.read(7_999).tobytes()
    off = data.find(target)
    assert off > 0
    data[off + 9] ^= 0x04
    (store / "data.mdb").write_bytes(bytes(data))
    one, two = verify_store(store, workers=1), verify_store(store, workers=2)
    assert one.to_dict() == two.to_dict()
    assert [(p.kind, p.index) for p in one.problems] == [("checksum", 7_999 - 7_999 % SPV)]

    metas = [page * 4096 + 16 for page in (0, 1)]  # LMDB 0.9's meta pages: (txnid, main database root)
    _, root = max(
        (struct.unpack_from("<Q", data, m + 128)[0], struct.unpack_from("<Q", data, m + 112)[0]) for m in metas
    )
    data[root * 4096 + 16 : root * 4096 + 4096] = b"\xa5" * (4096 - 16)  # garbage nodes in the main DB root
    (store / "data.mdb").write_bytes(bytes(data))
    one, two = verify_store(store, workers=1), verify_store(store, workers=2)
    assert one.to_dict() == two.to_dict()
    assert {p.kind for p in one.problems} == {"structure"} and not one.complete


def test_verify_beside_an_open_reader_and_while_a_writer_holds_the_store(store: Path) -> None:
    with StoreReader(store, lock=True) as r:
        report = verify_store(r, workers=2)
        assert report.ok and report.samples_checked == N and not report.structure_checked
    with open_writer(store) as w:  # the walk is skipped; the pass reads the registered snapshot
        report = verify_store(store, workers=2)
        assert report.ok and report.samples_checked == N
        assert any("writer is appending" in n for n in report.notes)
        x, y = make_data(10, 1, dtype=np.float16)
        w.append(x, y)  # the writer was not held off by the pass
    assert verify_store(store, workers=1).samples_checked == N + 10


# ---------------------------------------------------------------------------------------------- sizes, libraries


def test_workers_and_chunks_are_sized_by_the_data_and_the_memory() -> None:
    assert resolve_workers(3, 0) == 3
    assert resolve_workers(None, 1000) == 1  # a small store: this process
    assert resolve_workers(None, 1 << 50) == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="workers must be >= 1"):
        verify_store("checked-before-opening", workers=0)
    assert chunk_bytes(4 << 20, 2, 5000, available=16 << 30) == MIN_CHUNK  # 4 chunks a worker at least
    big = chunk_bytes(100 << 30, 2, 5000, available=16 << 30)
    assert MIN_CHUNK < big <= 32 << 20 and big % 4096 == 0
    assert chunk_bytes(100 << 30, 2, 5000, available=16 << 20) == MIN_CHUNK  # little memory: small reads
    assert chunk_bytes(10 << 20, 2, 3 << 20, available=16 << 30) == 3 << 20  # never less than one value


def test_the_fast_crc32_equals_zlib() -> None:
    import zlib

    rng = np.random.default_rng(0)
    fn = checksum_int("crc32")
    assert fn is not None
    for n in (0, 1, 255, 4096, 100_003):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert fn(b) == zlib.crc32(b)
        trailer = compute_checksum("crc32")(b)  # type: ignore[misc]
        assert np.frombuffer(trailer, trailer_dtype("crc32"))[0] == fn(b)
        t64 = compute_checksum("xxh64")(b)  # type: ignore[misc]
        assert np.frombuffer(t64, trailer_dtype("xxh64"))[0] == checksum_int("xxh64")(b)  # type: ignore[misc]
    assert checksum_int("none") is None and trailer_dtype("none").itemsize == 0


# ---------------------------------------------------------------------------------------------- CLI, a worker killed


def test_cli_workers_option(pristine: Path) -> None:
    from conftest import run_cli

    one = run_cli("verify", pristine, "--workers", "1", "--json", "--no-progress")
    two = run_cli("verify", pristine, "--workers", "2", "--json", "--no-progress")
    assert one.exit_code == two.exit_code == 0
    assert json.loads(one.stdout) == json.loads(two.stdout)
    bad = run_cli("verify", pristine, "--workers", "0")
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def _children(pid: int) -> list[Any]:
    import psutil

    try:
        return psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_a_worker_killed_is_one_line_and_leaves_nothing_behind(pristine: Path) -> None:
    psutil = pytest.importorskip("psutil")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root)
    cmd = [sys.executable, "-m", "lmdbstore", "verify", str(pristine), "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    seen: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:  # the walker and a worker: stop before work is done
            seen.update({c.pid: c for c in _children(proc.pid)})
            time.sleep(0.005)
        assert len(seen) >= 2, "verify started no worker processes"
        os.kill(proc.pid, signal.SIGSTOP)  # workers cannot start on more than their first chunks meanwhile
        time.sleep(1.0)
        seen.update({c.pid: c for c in _children(proc.pid)})
        live = [c for c in seen.values() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        live = [c for c in live if "resource_tracker" not in " ".join(c.cmdline())]  # multiprocessing's own helper
        victim = max(live, key=lambda c: c.create_time())  # the newest: a worker of the pass
        victim.kill()
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "died" in err and "Traceback" not in err
    assert out == ""
    deadline = time.monotonic() + 10
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in seen.values()):
        assert time.monotonic() < deadline, "a verify process outlived the command"
        time.sleep(0.05)
    assert verify_store(pristine, workers=1).ok  # the store is as it was, and no lock is left held
    with open_writer(pristine):
        pass
