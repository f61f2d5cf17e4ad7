"""No SIGBUS when data.mdb shrinks (lmdbstore.store.mapguard; issue 25 #7): a read lease holds truncation back
while the map is read, and without one the kernel copies (process_vm_readv answers EFAULT where a page lies past
the end of the file).  The end-to-end check truncates the file in a loop from another process while a reader
process reads warm random and block batches through the public API: one-line errors, never a signal."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, build_store, make_data

from lmdbstore.errors import CorruptStoreError
from lmdbstore.store.mapguard import MapGuard, vm_available, vm_copy

linux = pytest.mark.skipif(sys.platform != "linux", reason="leases and process_vm_readv are Linux's")


@linux
def test_a_kernel_copy_of_a_page_past_the_end_of_the_file_fails_instead_of_sigbus(tmp_path: Path) -> None:
    if not vm_available():
        pytest.skip("process_vm_readv is refused here (seccomp)")
    f = tmp_path / "f"
    f.write_bytes(bytes(range(256)) * 64)  # 4 pages
    fd = os.open(f, os.O_RDONLY)
    m = mmap.mmap(fd, 16384, prot=mmap.PROT_READ)
    base = np.frombuffer(m, np.uint8).ctypes.data
    out = np.zeros(300, np.uint8)
    lens = np.array([100, 200])
    assert vm_copy(out, np.array([0, 100]), base + np.array([5, 9000]), lens)
    np.testing.assert_array_equal(out[:100], np.arange(5, 105) % 256)
    os.truncate(f, 4096)
    assert not vm_copy(out, np.array([0, 100]), base + np.array([5, 9000]), lens)  # no signal: an answer
    assert vm_copy(out, np.array([0]), base + np.array([5]), np.array([100]))  # the first page is still there
    del out
    m.close()
    os.close(fd)


@linux
def test_a_held_lease_holds_truncation_back(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 8192)
    fd = os.open(f, os.O_RDONLY)
    guard = MapGuard(fd, f)
    code = f"import os; os.truncate({str(f)!r}, 100)"
    with guard.hold(8192) as leased:
        if not leased:
            pytest.skip("no lease on this file system")
        p = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.3)
        assert os.fstat(fd).st_size == 8192 and p.poll() is None  # waits for the lease
    assert p.wait(30) == 0 and os.fstat(fd).st_size == 100
    with pytest.raises(CorruptStoreError, match="truncated") as exc, guard.hold(8192):
        pass
    assert "\n" not in str(exc.value)
    os.close(fd)


READER = r"""
import collections, json, sys, time
import numpy as np
from lmdbstore import LmdbStoreError, StoreReader
path, secs, lmdb_too, xfile = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
x = np.load(xfile)
n = len(x)
r = StoreReader(path)
r.read_batch(np.arange(n))  # warm, every header checked
r2 = StoreReader(path, positions=False)
rng = np.random.default_rng(0)
stats = collections.Counter()
print("READY", flush=True)
end = time.monotonic() + secs
while time.monotonic() < end:
    for kind in ("random", "block") + (("lmdb", "labels") if lmdb_too else ()):
        try:
            if kind == "random":
                idx = rng.integers(0, n, 8192)
                assert (r.read_batch(idx) == x[idx]).all()
            elif kind == "block":
                lo = int(rng.integers(0, n - 4096))
                assert (r.read_batch(np.arange(lo, lo + 4096)) == x[lo : lo + 4096]).all()
            elif kind == "lmdb":
                idx = rng.integers(0, n, 256)
                assert (r2.read_batch(idx) == x[idx]).all()
            else:
                r.refresh()
                r.labels()
            stats["ok"] += 1
        except LmdbStoreError as exc:
            assert "\n" not in str(exc), str(exc)
            stats[type(exc).__name__] += 1
print(json.dumps(stats), flush=True)
"""

TRUNCATE = r"""
import os, sys, time
path, secs, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
orig = open(path, "rb").read()
cut = len(orig) // 3
end = time.monotonic() + secs
if mode == "open":  # each truncation opens the file (a reader's lease holds it back)
    while time.monotonic() < end:
        os.truncate(path, cut)
        time.sleep(0.001)
        with open(path, "r+b") as f:
            f.seek(cut)
            f.write(orig[cut:])
        time.sleep(0.002)
else:  # the file stays open for writing: no reader can take a lease, copies go through the kernel
    fd = os.open(path, os.O_RDWR)
    while time.monotonic() < end:
        os.ftruncate(fd, cut)
        time.sleep(0.001)
        os.pwrite(fd, orig[cut:], cut)
        time.sleep(0.002)
"""


@linux
@pytest.mark.parametrize("mode", ["open", "fd"])
def test_a_file_truncated_in_a_loop_under_warm_reads_is_never_a_signal(tmp_path: Path, mode: str) -> None:
    x, y = make_data(9000, seed=31)
    path = build_store(tmp_path / "s", x, y)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "reader.py").write_text(READER)
    (tmp_path / "truncate.py").write_text(TRUNCATE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    lmdb_too = "1" if mode == "open" else "0"  # liblmdb's own reads are safe only under a lease
    reader = subprocess.Popen(
        [sys.executable, str(tmp_path / "reader.py"), str(path), "1.2", lmdb_too, str(tmp_path / "x.npy")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert reader.stdout is not None and reader.stdout.readline().strip() == "READY"
    cut = subprocess.run(
        [sys.executable, str(tmp_path / "truncate.py"), str(path / "data.mdb"), "0.8", mode], timeout=120, check=False
    )
    out, err = reader.communicate(timeout=120)
    assert cut.returncode == 0
    assert reader.returncode == 0, (reader.returncode, err[-2000:])  # -7 was SIGBUS
    stats = json.loads(out.strip().splitlines()[-1])
    assert set(stats) <= {"ok", "CorruptStoreError"}, stats
    assert stats.get("CorruptStoreError", 0) > 0, stats  # it did read while the file was short
