"""Crash safety, concurrency, hostile files and resource faults, with real processes and real LMDB.

Every scenario that could take a process down (SIGKILL, SIGBUS on a truncated map, a full disk) runs
in a child process started from a helper script written to a temporary directory; the test then
checks the store from outside: verify passes, metadata, labels and samples agree with the
deterministic source, and nothing committed was lost.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import REPO, half_created

from lmdbstore import (
    CorruptStoreError,
    FormatVersionError,
    LmdbStoreError,
    NotAStoreError,
    StoreFullError,
    StoreLockedError,
    StoreNotFoundError,
    StoreReader,
    WriterConfig,
    open_writer,
)
from lmdbstore.tools.verify import verify_store

SHAPE = (25, 25)
CLASSES = ["a", "b", "c", "d", "e"]
N = 20_000  # 50 MB of 25x25 float32: about 70 commits of 512 KiB to 1 MiB
SEED = 1234

# The helper run in child processes.  ``source(n)`` must equal the test's ``_source(n)``.
HELPER = r'''
import json, os, signal, sys, threading, time
import numpy as np
from lmdbstore import LmdbStoreError, StoreReader, WriterConfig, open_writer
from lmdbstore.tools.verify import verify_store

SHAPE, CLASSES, SEED = (25, 25), ["a", "b", "c", "d", "e"], 1234


def source(n):
    # two streams, so that source(n) is a prefix of source(m) for n < m
    x = np.random.default_rng(SEED).standard_normal((n, *SHAPE), dtype=np.float32)
    return x, np.random.default_rng(SEED + 1).integers(0, 5, n)


def err(exc):
    return f"{type(exc).__name__}: {exc}"


def ingest(path, n, run, pause):
    """Append the source in random-sized batches, recording the position in the ledger; print
    'C <committed>' after every commit so the parent can kill at a known stage."""
    x, y = source(n)
    cfg = WriterConfig(commit_bytes=512 << 10, initial_map_size=1 << 20)
    w = open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES, config=cfg)
    pos = w.progress("src")
    assert pos == w.committed, (pos, w.committed)
    print("START", pos, flush=True)
    sizes = np.random.default_rng(1000 + run)
    committed = w.committed
    while pos < n:
        k = int(sizes.integers(1, 200))
        w.append(x[pos : pos + k], y[pos : pos + k], progress=("src", min(pos + k, n)))
        pos = min(pos + k, n)
        if w.committed != committed:
            committed = w.committed
            print("C", committed, flush=True)
        if pause:
            time.sleep(pause)
    w.close()
    print("DONE", w.committed, flush=True)


def reader(path, n, deadline):
    """Refresh a lock=True reader until the count reaches n; every snapshot must be whole."""
    x, y = source(n)
    r = StoreReader(path, lock=True)
    seen, failures, it = [], [], 0
    rng = np.random.default_rng(0)
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        r.refresh()
        m = r.meta
        c = m.count
        if not seen or seen[-1] != c:
            seen.append(c)
        if it == 0:
            print("READY", c, flush=True)
        try:
            labels = r.labels()
            assert len(labels) == c and np.array_equal(labels, y[:c]), "labels"
            assert m.class_counts == np.bincount(y[:c], minlength=5).tolist(), "class_counts"
            ledger = {bytes(k): json.loads(bytes(v)) for k, v in r.iter_raw(b"progress")}
            assert ledger[b"src"]["done"] == c, ("ledger", ledger, c)
            lo = max(0, c - 50)
            assert np.array_equal(r.read_range(lo, c), x[lo:c]), "tail samples"
            idx = rng.integers(0, c, 64)
            assert np.array_equal(r.read_batch(idx), x[idx]), "random samples"
            for k in range(5):
                assert np.array_equal(r.class_indices(k)[-20:], np.flatnonzero(y[:c] == k)[-20:]), "classidx"
            if it % 4 == 0:
                rep = verify_store(r)
                assert rep.ok, [str(p) for p in rep.problems]
        except AssertionError as exc:
            failures.append(f"count {c}: {exc}")
        it += 1
        if c >= n:
            break
    print(json.dumps({"seen": seen, "iterations": it, "failures": failures}), flush=True)


def try_write(path):
    try:
        w = open_writer(path)
    except LmdbStoreError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        return
    w.close()
    print(json.dumps({"error": None}))


def try_open(paths):
    """Every way of opening each path; one JSON line per path.  Exits 0 unless something crashes."""
    for p in paths:
        out = {}
        for name, fn in [
            ("reader", lambda: StoreReader(p).open().labels()),
            ("reader_lock", lambda: StoreReader(p, lock=True).open().labels()),
            ("verify", lambda: verify_store(p)),
            ("writer", lambda: open_writer(p).close()),
        ]:
            try:
                fn()
                out[name] = None
            except LmdbStoreError as exc:
                out[name] = [type(exc).__name__, str(exc)]
            import gc
            gc.collect()
        print(json.dumps(out), flush=True)


def fill(path):
    """Append until the disk is full; report what was committed."""
    x, y = source(4000)
    cfg = WriterConfig(commit_bytes=256 << 10, initial_map_size=1 << 20)
    committed = 0
    try:
        with open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES, config=cfg) as w:
            for lo in range(0, len(x), 100):
                w.append(x[lo : lo + 100], y[lo : lo + 100], progress=("src", lo + 100))
                committed = w.committed
    except LmdbStoreError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc), "committed": committed}))
        return
    print(json.dumps({"error": None, "committed": committed}))


def forker(path, total, lock):
    """Fork readers in batches of 10, let each read, SIGKILL it.  Exit 1 if any reader fails."""
    killed = 0
    while killed < total:
        rfd, wfd = os.pipe()
        pids = []
        for _ in range(min(10, total - killed)):
            pid = os.fork()
            if pid == 0:
                os.close(rfd)
                code = 0
                try:
                    r = StoreReader(path, lock=lock).open()
                    r.read(5)
                    r.labels()
                    os.write(wfd, b"k")
                    time.sleep(60)
                except BaseException as exc:
                    os.write(wfd, b"E")
                    print("reader failed:", err(exc), flush=True)
                    code = 3
                os._exit(code)
            pids.append(pid)
        os.close(wfd)
        got = b""
        while len(got) < len(pids):
            chunk = os.read(rfd, 64)
            if not chunk:
                break
            got += chunk
        os.close(rfd)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        killed += len(pids)
        if got != b"k" * len(pids):
            print("FAILED after", killed, flush=True)
            sys.exit(1)
    print("OK", killed, flush=True)


def create_killed(base, n):
    """Create stores base/0 .. base/n-1 with open_writer, each in a forked child that SIGKILLs itself
    after a delay spread over the time one creation takes (measured first); one JSON line per child."""
    kw = dict(shape=SHAPE, dtype="float32", classes=CLASSES)
    took = []
    for i in range(3):
        t0 = time.perf_counter()
        open_writer(os.path.join(base, f"warm{i}"), **kw).close()
        took.append(time.perf_counter() - t0)
    creation = sorted(took)[1]
    for i in range(n):
        path = os.path.join(base, str(i))
        pid = os.fork()
        if pid == 0:
            try:
                sys.setswitchinterval(1e-5)  # let the timer thread run the moment it is due
                threading.Timer(creation * i / n, os.kill, (os.getpid(), signal.SIGKILL)).start()
                open_writer(path, **kw)
                time.sleep(60)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps({"path": path, "killed": killed}), flush=True)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "ingest":
        ingest(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif cmd == "reader":
        reader(args[0], int(args[1]), float(args[2]))
    elif cmd == "try_write":
        try_write(args[0])
    elif cmd == "try_open":
        try_open(args)
    elif cmd == "fill":
        fill(args[0])
    elif cmd == "forker":
        forker(args[0], int(args[1]), args[2] == "1")
    elif cmd == "create_killed":
        create_killed(args[0], int(args[1]))
'''


def _source(n: int) -> tuple[np.ndarray, np.ndarray]:
    # two streams, so that source(n) is a prefix of source(m) for n < m
    x = np.random.default_rng(SEED).standard_normal((n, *SHAPE), dtype=np.float32)
    return x, np.random.default_rng(SEED + 1).integers(0, 5, n)


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("helper") / "helper.py"
    path.write_text(HELPER)
    return path


@pytest.fixture(scope="module")
def source() -> tuple[np.ndarray, np.ndarray]:
    return _source(N)


def _run(helper: Path, *args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(helper), *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def _popen(helper: Path, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(helper), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _ledger(r: StoreReader) -> dict[str, int]:
    return {bytes(k).decode(): json.loads(bytes(v))["done"] for k, v in r.iter_raw(b"progress")}


def _check_store(path: Path, x: np.ndarray, y: np.ndarray) -> int:
    """The store verifies clean and holds exactly a prefix of the source; returns its count."""
    report = verify_store(path)
    assert report.ok, [str(p) for p in report.problems]
    assert report.structure_checked or importlib.util.find_spec("lmdb.verify") is None  # py-lmdb < 3.0
    with StoreReader(path) as r:
        c = len(r)
        assert _ledger(r) == {"src": c}
        np.testing.assert_array_equal(r.read_range(0, c), x[:c])
        np.testing.assert_array_equal(r.labels(), y[:c])
        assert r.meta.class_counts == np.bincount(y[:c], minlength=5).tolist()
        for k in range(5):
            np.testing.assert_array_equal(r.class_indices(k), np.flatnonzero(y[:c] == k))
    return c


def _small_store(path: Path, n: int = 500) -> Path:
    x, y = _source(n)
    with open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES) as w:
        w.append(x, y, progress=("src", n))
    return path


# ---------------------------------------------------------------------------------------------- crash safety


def _kill_after_commits(proc: subprocess.Popen[str], commits: int, delay: float) -> tuple[int, int]:
    """Read the child's lines until ``commits`` commits were reported, wait ``delay``, SIGKILL it.

    Returns (position at START, last committed count the child reported before the kill).
    """
    assert proc.stdout is not None
    start, last, seen = -1, 0, 0
    for line in proc.stdout:
        word, value = line.split()
        if word == "START":
            start = last = int(value)
        elif word == "C":
            last, seen = int(value), seen + 1
            if seen >= commits:
                break
        elif word == "DONE":
            raise AssertionError("the ingest finished before it could be killed")
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    return start, last


def test_sigkill_during_ingest_then_resume(tmp_path: Path, helper: Path, source: tuple[np.ndarray, np.ndarray]) -> None:
    """Kill an ingest with SIGKILL at random moments; every time the store is whole and durable, and
    resuming from the ledger ends with exactly the source: nothing lost, nothing duplicated."""
    x, y = source
    path = tmp_path / "store"
    rng = np.random.default_rng(99)
    counts = []
    for run in range(5):
        proc = _popen(helper, "ingest", path, N, run, 0)
        start, reported = _kill_after_commits(proc, int(rng.integers(1, 7)), float(rng.uniform(0, 0.03)))
        c = _check_store(path, x, y)
        assert start == (counts[-1] if counts else 0)  # the rerun resumed exactly where the store was
        assert reported <= c < N  # every commit reported before the kill survived it
        counts.append(c)
    assert counts == sorted(counts) and counts[-1] > counts[0]
    done = _run(helper, "ingest", path, N, 99, 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["START", str(counts[-1])] and done.stdout.split()[-2:] == ["DONE", str(N)]
    assert _check_store(path, x, y) == N
    again = _run(helper, "ingest", path, N, 100, 0)  # a rerun of a finished ingest adds nothing
    assert again.returncode == 0 and again.stdout.split() == ["START", str(N), "DONE", str(N)]
    assert _check_store(path, x, y) == N


# ---------------------------------------------------------------------------------------------- concurrency


def test_lock_true_readers_see_whole_snapshots_while_a_writer_appends(
    tmp_path: Path, helper: Path, source: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = source
    path = tmp_path / "store"
    with open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES) as w:
        w.append(x[:1000], y[:1000], progress=("src", 1000))
    reader = _popen(helper, "reader", path, N, 120)
    assert reader.stdout is not None
    assert reader.stdout.readline().split() == ["READY", "1000"]
    writer = _run(helper, "ingest", path, N, 7, 0.002, timeout=120)
    out, errs = reader.communicate(timeout=120)
    assert writer.returncode == 0, writer.stderr
    assert reader.returncode == 0, errs
    result = json.loads(out.strip().splitlines()[-1])
    assert result["failures"] == []
    seen = result["seen"]
    committed = {1000} | {
        int(v) for word, v in (ln.split() for ln in writer.stdout.splitlines()) if word in ("C", "DONE")
    }
    assert seen[0] == 1000 and seen[-1] == N and seen == sorted(seen)
    assert set(seen) <= committed  # only committed states were ever visible
    assert _check_store(path, x, y) == N


def test_second_writer_is_refused_in_process_and_across_processes(tmp_path: Path, helper: Path) -> None:
    path = _small_store(tmp_path / "store")
    x, y = _source(600)
    with open_writer(path) as w:
        w.append(x[500:], y[500:], progress=("src", 600))
        with pytest.raises(StoreLockedError, match="another writer"):
            open_writer(path)
        other = _run(helper, "try_write", path)
        assert other.returncode == 0, other.stderr
        refused = json.loads(other.stdout)
        assert refused["error"] == "StoreLockedError"
        assert "another writer is using this store" in refused["message"] and "\n" not in refused["message"]
        # readers (and verify) in other processes are not blocked by the writer; writers are
        others = json.loads(_run(helper, "try_open", path).stdout)
        assert others["reader"] is None and others["reader_lock"] is None and others["verify"] is None
        assert others["writer"][0] == "StoreLockedError"
    ok = _run(helper, "try_write", path)
    assert json.loads(ok.stdout) == {"error": None}
    assert _check_store(path, x, y) == 600


def test_killed_readers_do_not_exhaust_reader_slots(tmp_path: Path, helper: Path) -> None:
    """LMDB has 126 reader slots; a reader SIGKILLed inside a read transaction leaves its slot taken
    for as long as any process keeps the environment open.  Opening a lock=True reader clears the
    slots of dead processes (``reader_check``), so 150 killed readers leave the store usable."""
    path = _small_store(tmp_path / "store")
    with StoreReader(path, lock=True) as holder:  # keeps the environment (and its reader table) alive
        env = holder._handle().env
        slots_before = len(env.readers().splitlines())
        for lock, total in (("1", 150), ("0", 50)):  # lock=False readers take no slot at all
            res = _run(helper, "forker", path, total, lock, timeout=120)
            assert res.returncode == 0 and res.stdout.split() == ["OK", str(total)], res.stdout + res.stderr
        holder.refresh()
        assert len(holder) == 500
        assert len(holder._handle().env.readers().splitlines()) <= slots_before + 1
    res = _run(helper, "try_open", path)
    assert json.loads(res.stdout) == {"reader": None, "reader_lock": None, "verify": None, "writer": None}


# ---------------------------------------------------------------------------------------------- hostile files


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "lock.mdb"}


def test_truncated_data_file_is_an_error_not_a_crash(tmp_path: Path, helper: Path) -> None:
    base = _small_store(tmp_path / "base", n=2000)
    size = (base / "data.mdb").stat().st_size
    cuts = {"empty": 0, "one_page": 4096, "half": size // 2, "minus_one_page": size - 4096}
    paths = []
    for name, cut in cuts.items():
        p = tmp_path / name
        shutil.copytree(base, p)
        os.truncate(p / "data.mdb", cut)
        paths.append(p)
    before = {p.name: _snapshot(p) for p in paths}
    res = _run(helper, "try_open", *paths)
    assert res.returncode == 0, res.stderr  # no SIGBUS, no segfault
    lines = [json.loads(ln) for ln in res.stdout.splitlines()]
    assert len(lines) == len(paths)
    for p, line in zip(paths, lines, strict=True):
        for how, outcome in line.items():
            assert outcome is not None, (p.name, how)
            kind, message = outcome
            assert kind in ("CorruptStoreError", "NotAStoreError"), (p.name, how, outcome)
            assert "truncated" in message and "\n" not in message
        assert _snapshot(p) == before[p.name]  # nothing was written to the damaged store


def _put_meta(path: Path, raw: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"meta", raw, db=env.open_db(b"meta", txn=txn))
    finally:
        env.close()


class _Evil:
    """Unpickling this would create a marker file: proof that metadata is never unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def _bad_metas(good: dict[str, object], marker: Path) -> dict[str, tuple[bytes, type[LmdbStoreError], str]]:
    def edit(**changes: object) -> bytes:
        return json.dumps({**good, **changes}).encode()

    return {
        "malformed_json": (b'{"format": "lmdbstore", "count": ', CorruptStoreError, "not valid JSON"),
        "not_an_object": (b"[1, 2, 3]", CorruptStoreError, "not a JSON object"),
        "pickle": (pickle.dumps(_Evil(marker)), CorruptStoreError, "metadata"),
        "other_format": (edit(format="hdf5"), CorruptStoreError, "format"),
        "version_99": (edit(format_version=99), FormatVersionError, "unsupported format version 99"),
        "negative_shape": (edit(shape=[-1, 25]), CorruptStoreError, "shape"),
        "huge_shape": (edit(shape=[1 << 40]), CorruptStoreError, "shape"),
        "huge_sample": (edit(shape=[65536, 65536]), CorruptStoreError, "exceeds"),
        "object_dtype": (edit(dtype="O"), CorruptStoreError, "dtype"),
        "unicode_dtype": (edit(dtype="<U10"), CorruptStoreError, "dtype"),
        "negative_count": (edit(count=-1), CorruptStoreError, "count"),
        "huge_count": (edit(count=1 << 40, class_counts=[1 << 40, 0, 0, 0, 0]), CorruptStoreError, "data file holds"),
        "counts_disagree": (edit(class_counts=[1, 1, 1, 1, 1]), CorruptStoreError, "class_counts"),
        "missing_field": (
            json.dumps({k: v for k, v in good.items() if k != "samples_per_value"}).encode(),
            CorruptStoreError,
            "samples_per_value",
        ),
    }


def test_hostile_metadata_gives_clear_errors(tmp_path: Path) -> None:
    base = _small_store(tmp_path / "base")
    with StoreReader(base) as r:
        good = json.loads(r.meta.to_json())
    marker = tmp_path / "unpickled"
    for name, (raw, error, text) in _bad_metas(good, marker).items():
        p = tmp_path / name
        shutil.copytree(base, p)
        _put_meta(p, raw)
        before = _snapshot(p)
        for how, fn in [
            ("reader", lambda p=p: StoreReader(p).open()),
            ("reader_lock", lambda p=p: StoreReader(p, lock=True).open()),
            ("verify", lambda p=p: verify_store(p)),
            ("writer", lambda p=p: open_writer(p).close()),
        ]:
            with pytest.raises(error) as info:
                fn()
            message = str(info.value)
            assert text in message and "\n" not in message and str(p) in message, (name, how, message)
        assert _snapshot(p) == before, name
    assert not marker.exists()


def _foreign_env(path: Path, named: dict[bytes, dict[bytes, bytes]], plain: dict[bytes, bytes]) -> Path:
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            for k, v in plain.items():
                txn.put(k, v)
            for name, items in named.items():
                db = env.open_db(name, txn=txn)
                for k, v in items.items():
                    txn.put(k, v, db=db)
    finally:
        env.close()
    return path


def test_things_that_are_not_stores(tmp_path: Path, helper: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    (tmp_path / "file").write_bytes(b"data")
    cases: dict[Path, type[LmdbStoreError]] = {
        tmp_path / "missing": StoreNotFoundError,
        tmp_path / "plain": NotAStoreError,
        tmp_path / "file": NotAStoreError,
        _foreign_env(tmp_path / "foreign_plain", {}, {b"hello": b"world"}): NotAStoreError,
        _foreign_env(tmp_path / "foreign_meta_key", {}, {b"meta": b"{}"}): NotAStoreError,
        _foreign_env(tmp_path / "foreign_db", {b"things": {b"a": b"b"}}, {}): NotAStoreError,
    }
    with StoreReader(_small_store(tmp_path / "good")) as r:
        good = r.meta.to_json()
    no_samples = _foreign_env(tmp_path / "meta_only", {b"meta": {b"meta": good}}, {})
    cases[no_samples] = CorruptStoreError
    for path, error in cases.items():
        for fn in (lambda p=path: StoreReader(p).open(), lambda p=path: verify_store(p)):
            with pytest.raises(error) as info:
                fn()
            assert "\n" not in str(info.value) and str(path) in str(info.value)
        if path.name != "missing" and path.name != "plain":  # an empty/new dir would become a store
            with pytest.raises(error):
                open_writer(path)
    assert not (tmp_path / "missing").exists()
    assert not (tmp_path / "plain" / "data.mdb").exists()
    res = _run(helper, "try_open", tmp_path / "foreign_meta_key")
    outcome = json.loads(res.stdout)
    assert res.returncode == 0 and {v[0] for v in outcome.values()} == {"NotAStoreError"}


def test_malformed_ledger_entry_is_a_corrupt_store_error(tmp_path: Path) -> None:
    path = _small_store(tmp_path / "store")
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"src", pickle.dumps({"done": 1}), db=env.open_db(b"progress", txn=txn))
    env.close()
    with open_writer(path) as w, pytest.raises(CorruptStoreError, match="resume-ledger"):
        w.progress("src")
    report = verify_store(path)
    assert [p.kind for p in report.problems] == ["progress"]


# ---------------------------------------------------------------------------------------------- resource faults


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, where this test may mount one (root on Linux); skipped otherwise."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root on Linux")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"mount -t tmpfs refused here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_during_ingest(tiny_tmpfs: Path, tmp_path: Path, helper: Path) -> None:
    path = tiny_tmpfs / "store"
    res = _run(helper, "fill", path)
    assert res.returncode == 0, res.stderr  # no crash
    outcome = json.loads(res.stdout)
    assert outcome["error"] == "StoreFullError", outcome
    assert "no space left on device" in outcome["message"] and "\n" not in outcome["message"]
    x, y = _source(4000)
    c = _check_store(path, x, y)
    assert c == outcome["committed"] and 0 < c < 4000
    # after freeing space (here: moving the store to a roomy disk) the ingest resumes
    roomy = tmp_path / "roomy"
    shutil.copytree(path, roomy, ignore=shutil.ignore_patterns("lock.mdb"))
    with open_writer(roomy) as w:
        assert w.progress("src") == c
        w.append(x[c:], y[c:], progress=("src", 4000))
    assert _check_store(roomy, x, y) == 4000


def test_map_full_with_growth_refused(tmp_path: Path) -> None:
    path = tmp_path / "store"
    x, y = _source(3000)
    cfg = WriterConfig(commit_bytes=128 << 10, initial_map_size=1 << 20, max_map_size=2 << 20)
    committed = 0
    with (
        pytest.raises(StoreFullError) as info,
        open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES, config=cfg) as w,
    ):
        for lo in range(0, 3000, 50):
            w.append(x[lo : lo + 50], y[lo : lo + 50], progress=("src", lo + 50))
            committed = w.committed
    message = str(info.value)
    assert "map is full" in message and "max_map_size" in message and "\n" not in message
    assert 0 < committed < 3000
    assert _check_store(path, x, y) == committed
    # reopening with the same ceiling does not silently exceed it
    with pytest.raises(StoreFullError), open_writer(path, config=cfg) as w:
        w.append(x[committed : committed + 1000], y[committed : committed + 1000], progress=("src", committed + 1000))
        w.commit()
    assert _check_store(path, x, y) == committed
    # with the ceiling lifted, the ingest resumes from the ledger and completes
    with open_writer(path, config=WriterConfig(initial_map_size=1 << 20)) as w:
        start = w.progress("src")
        assert start == committed
        w.append(x[start:], y[start:], progress=("src", 3000))
    assert _check_store(path, x, y) == 3000


def _count_now(path: Path) -> int:
    """Committed count as a lock=True reader sees it (0 while the store is being created)."""
    try:
        with StoreReader(path, lock=True) as r:
            return len(r)
    except LmdbStoreError:
        return 0


def test_sigkill_cli_ingest_then_rerun_the_same_command(tmp_path: Path, source: tuple[np.ndarray, np.ndarray]) -> None:
    """Kill the real ``lmdbstore ingest`` of an .npy twice mid-write; rerunning the same command
    finishes with exactly the file's samples (the CLI keeps a resume entry per source)."""
    pytest.importorskip("lmdbstore_cli.main")
    x = source[0][:20_000]
    npy = tmp_path / "x.npy"
    np.save(npy, x)
    path = tmp_path / "store"
    cmd = [sys.executable, "-m", "lmdbstore", "ingest", str(path), str(npy)]
    cmd += ["--label", "b", "--classes", ",".join(CLASSES), "--commit-mb", "1", "--no-progress"]
    counts = []
    for target in (3000, 11_000):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while proc.poll() is None and _count_now(path) < target:
                time.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == -signal.SIGKILL, "the ingest finished before it could be killed"
        report = verify_store(path)
        assert report.ok, [str(p) for p in report.problems]
        with StoreReader(path) as r:
            c = len(r)
            assert (_ledger(r) == {} and c == 0) or list(_ledger(r).values()) == [c]
            np.testing.assert_array_equal(r.read_range(0, c), x[:c])
            assert np.all(r.labels() == 1) and r.meta.class_counts == [0, c, 0, 0, 0]
        assert c < len(x)
        counts.append(c)
    assert counts[1] >= counts[0] >= 3000
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{counts[1]:,} already in the store" in done.stdout
    assert verify_store(path).ok
    with StoreReader(path) as r:
        assert len(r) == len(x)
        np.testing.assert_array_equal(r.read_range(0, len(x)), x)
        np.testing.assert_array_equal(r.class_indices(1), np.arange(len(x)))


# ------------------------------------------------------------------------- a creation interrupted before its first commit


def _creation_state(path: Path) -> str:
    """What a killed creation left: "absent", "empty", "interrupted" (not yet a store) or "store"."""
    if not path.exists():
        return "absent"
    if not any(path.iterdir()):
        return "empty"
    try:
        StoreReader(path).open().close()
    except NotAStoreError as exc:
        text = str(exc)
        assert "creation was interrupted" in text and "rerun the ingest" in text and "\n" not in text, text
        return "interrupted"
    return "store"


def test_sigkill_during_store_creation_always_leaves_a_resumable_directory(tmp_path: Path, helper: Path) -> None:
    """Kill real ``open_writer`` creations at moments spread over the creation window; whatever each
    kill leaves, rerunning ``open_writer`` with the same arguments creates the store, and it verifies."""
    x, y = _source(50)
    seen: dict[str, int] = {}
    for attempt in range(6):
        base = tmp_path / f"round{attempt}"
        base.mkdir()
        res = _run(helper, "create_killed", base, 24, timeout=120)
        assert res.returncode == 0, res.stderr
        lines = [json.loads(line) for line in res.stdout.splitlines()]
        assert len(lines) == 24
        for line in lines:
            assert line["killed"], line
            path = Path(line["path"])
            state = _creation_state(path)
            seen[state] = seen.get(state, 0) + 1
            with open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES) as w:
                assert w.count == 0
                w.append(x, y, progress=("src", 50))
            assert _check_store(path, x, y) == 50
        if seen.get("interrupted", 0) >= 3:
            break
    assert seen.get("interrupted", 0) >= 1, f"no kill landed inside the creation window: {seen}"


def test_cli_ingest_completes_an_interrupted_creation(tmp_path: Path) -> None:
    pytest.importorskip("lmdbstore_cli.main")
    store = half_created(tmp_path / "store", "empty_env")
    x, y = _source(300)
    npz = tmp_path / "a.npz"
    np.savez(npz, x=x, y=np.array(CLASSES)[y])
    cli = [sys.executable, "-m", "lmdbstore"]
    p = subprocess.run([*cli, "stats", str(store)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.startswith("error: ") and p.stderr.strip().count("\n") == 0, p.stderr
    assert "creation was interrupted" in p.stderr and "Traceback" not in p.stderr
    ingest = [*cli, "ingest", str(store), str(npz), "--classes", ",".join(CLASSES), "--no-progress"]
    p = subprocess.run(ingest, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "created" in p.stdout and "+300 samples" in p.stdout
    p = subprocess.run([*cli, "stats", str(store), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["samples"] == 300
    assert verify_store(store).ok
    with StoreReader(store) as r:
        np.testing.assert_array_equal(r.read_range(0, 300), x)
        np.testing.assert_array_equal(r.labels(), y)


_APPENDER = """
import sys
import numpy as np
from lmdbstore import open_writer
x = np.random.default_rng(0).standard_normal((20, 25, 25)).astype(np.float32)
y = np.arange(20) % 5
with open_writer(sys.argv[1]) as w:
    w.append(x, y)
    w.commit()
    print("ready", flush=True)
    while True:  # small commits: pages freed by one commit are reused by the next but one
        w.append(x, y)
        w.commit()
"""


def test_readers_take_a_registered_snapshot_while_a_writer_is_active(tmp_path: Path) -> None:
    from conftest import build_store, make_data, run_cli

    from lmdbstore import StoreReader

    x, y = make_data(1000, 2)
    store = build_store(tmp_path / "store", x, y)
    r = StoreReader(store).open()
    assert r._handle().lock is False  # nobody writes: lock-free
    r.close()
    script = tmp_path / "appender.py"
    script.write_text(_APPENDER)
    root = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(store)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=root),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        r = StoreReader(store).open()
        assert r._handle().lock is True  # a writer is active: a snapshot in LMDB's reader table
        r.close()
        for _ in range(3):  # in this process (CliRunner): the writer is another process all the same
            for args in (["stats", store, "--sample", "500"], ["verify", store, "--no-progress"]):
                p = run_cli(*args)
                assert p.exit_code == 0, (args, p.stderr)
                assert p.stderr.strip() == "" or "Traceback" not in p.stderr
    finally:
        proc.kill()
        proc.wait()
