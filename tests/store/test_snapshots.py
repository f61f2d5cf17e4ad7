"""The snapshot rule (lmdbstore.store.snapshot) in the scenarios where a reader used to read another commit's
bytes in silence: two readers in one process beside a writer, a writer growing the map a reader shares, a
lock-free reader and a writer that starts after it, a store replaced at its path, a writer or a registered
reader open in a parent that forks DataLoader workers, window training beside a writer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, build_store, edit_meta_text, make_data

from lmdbstore import LmdbStoreError, LoaderConfig, WriterConfig, open_writer
from lmdbstore.format.meta import StoreMeta
from lmdbstore.frameworks.torch_data import LmdbBatchDataset, make_loader
from lmdbstore.loader.samplers import EpochBatchSampler
from lmdbstore.store.reader import StoreReader
from lmdbstore.tools.copy import copy_store

CFG = WriterConfig(sync=False, initial_map_size=1 << 20)


def _append_script(path: Path, commits: int, wait: bool = False) -> str:
    """A writer process appending ``commits`` commits of 40 samples of -1.0 (after a line on stdin if ``wait``)."""
    return textwrap.dedent(
        f"""
        import sys, numpy as np
        from lmdbstore import open_writer, WriterConfig
        w = open_writer({str(path)!r}, config=WriterConfig(sync=False, initial_map_size=1 << 20))
        print("started", flush=True)
        if {wait!r}:
            sys.stdin.readline()
        for c in range({commits}):
            w.append(np.full((40, 25, 25), -1.0, np.float32), c % 5)
            w.commit()
        w.close()
        print("done", flush=True)
        """
    )


def _writer(path: Path, commits: int, wait: bool = False) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", _append_script(path, commits, wait)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "started"
    return p


def _go(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "done"
    assert p.wait(60) == 0


def test_two_readers_in_one_process_keep_their_snapshots(tmp_path: Path) -> None:
    """The second reader's open used to resize the shared map, ending the first one's registered snapshot;
    the writer's next commits then reused its pages (the rewritten last value came back wrong)."""
    x, y = make_data(2000, seed=1)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    p = _writer(path, 60, wait=True)
    a = StoreReader(path)  # a writer holds the store: a registered snapshot
    np.testing.assert_array_equal(a.read_batch(np.arange(2000)), x)
    b = StoreReader(path).open()  # same process, same environment
    assert a._handle().snapshot.registered and a._handle().protected()  # b's open ended nothing
    _go(p)
    for _ in range(3):
        np.testing.assert_array_equal(a.read_batch(np.arange(2000)), x)
    assert len(a) == 2000 and len(b) == 2000  # both still on their snapshot
    a.close()
    b.close()


def test_a_writer_growing_the_map_a_reader_shares(tmp_path: Path) -> None:
    """A writer in this process doubles its map (py-lmdb's set_mapsize ends every transaction of the shared
    environment); the reader notices and re-snapshots instead of reading pages the writer reuses."""
    x, y = make_data(1000, seed=2)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    r = StoreReader(path, lock=True).open()
    firsts = list(x[:, 0, 0])
    with open_writer(path, config=CFG) as w:
        first_map = w._env.info()["map_size"]
        for c in range(120):
            w.append(np.full((40, 25, 25), float(c), np.float32), c % 5)
            w.commit()
            firsts += [float(c)] * 40
            n = len(r)
            np.testing.assert_array_equal(r.read_range(max(0, n - 60), n)[:, 0, 0], firsts[max(0, n - 60) : n])
        assert w._env.info()["map_size"] > first_map
    r.close()


def test_a_lock_free_reader_notices_a_writer_that_starts_later(tmp_path: Path) -> None:
    x, y = make_data(2000, seed=3)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    r = StoreReader(path).open()
    assert not r._handle().snapshot.registered  # nobody writes: lock-free
    np.testing.assert_array_equal(r.read_batch(np.arange(2000)), x)
    p = _writer(path, 80)
    while p.poll() is None:
        n = len(r)
        got = r.read_range(max(0, n - 50), n)
        want = np.concatenate([x[:, 0, 0], np.full(max(0, n - 2000), -1.0, np.float32)])[max(0, n - 50) :]
        np.testing.assert_array_equal(got[:, 0, 0], want)
        zeros = r.class_indices(0)  # from the snapshot it reads now, as the label table is
        np.testing.assert_array_equal(zeros, np.flatnonzero(r.labels() == 0))
        assert len(r.labels()) == len(r)
    assert p.wait(60) == 0
    assert r._handle().snapshot.registered  # it took a registered snapshot once it saw the writer
    r.close()


def test_an_explicit_lock_false_reader_is_right_or_says_so(tmp_path: Path) -> None:
    x, y = make_data(2000, seed=4)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    r = StoreReader(path, lock=False).open()
    p = _writer(path, 80)
    refused = 0
    while p.poll() is None:
        try:
            np.testing.assert_array_equal(r.read_range(1900, 2000), x[1900:])
        except LmdbStoreError as exc:
            assert "lock=None or lock=True" in str(exc) and "\n" not in str(exc)
            refused += 1
    assert not r._handle().snapshot.registered  # it stays lock-free, as asked
    r.close()


def _replace_with_compact_copy(path: Path, other: Path, tmp_path: Path) -> None:
    """``rm -r path`` then ``lmdbstore copy --compact other path`` (compact copies start afresh)."""
    shutil.rmtree(path)
    copy_store(other, path, compact=True)


def test_a_store_replaced_at_its_path_is_never_read_at_old_offsets(tmp_path: Path) -> None:
    xa, ya = make_data(2000, seed=5)
    xb, yb = make_data(2000, seed=6)
    a = build_store(tmp_path / "a", xa, ya, config=CFG)
    b = build_store(tmp_path / "b", xb, yb, config=CFG)
    r = StoreReader(a)
    np.testing.assert_array_equal(r.read_batch(np.arange(2000)), xa)
    old_key = r._table.key if r._table is not None else None
    r.close()  # the table stays with the reader
    _replace_with_compact_copy(a, b, tmp_path)
    with pytest.raises(LmdbStoreError, match="replaced") as exc:  # an implicit re-open: not the same store
        r.read_batch([0])
    assert "\n" not in str(exc.value)
    r.refresh()  # asks for whatever is there now
    np.testing.assert_array_equal(r.read_batch(np.arange(2000)), xb)
    assert r._handle().table_source == "built" and r._table is not None and r._table.key != old_key


def test_a_pickled_reader_refuses_a_replaced_store(tmp_path: Path) -> None:
    """A spawned DataLoader worker gets the reader pickled: the identity of the store travels with it."""
    import pickle

    xa, ya = make_data(500, seed=7)
    a = build_store(tmp_path / "a", xa, ya, config=CFG)
    b = build_store(tmp_path / "b", *make_data(500, seed=8), config=CFG)
    r = StoreReader(a).open()
    blob = pickle.dumps(r)
    r.close()
    np.testing.assert_array_equal(pickle.loads(blob).read_batch([3]), xa[[3]])
    _replace_with_compact_copy(a, b, tmp_path)
    with pytest.raises(LmdbStoreError, match="replaced"):
        pickle.loads(blob).read_batch([3])


def test_store_ids(tmp_path: Path) -> None:
    x, y = make_data(300, seed=9)
    a = build_store(tmp_path / "a", x, y, config=CFG)
    with StoreReader(a) as r:
        sid = r.meta.store_id
    assert len(sid) == 32 and int(sid, 16) >= 0
    copy_store(a, tmp_path / "c")
    with StoreReader(tmp_path / "c") as r:
        assert r.meta.store_id not in ("", sid)
    # a store written before ids existed (no field) reads; an unknown field is ignored
    edit_meta_text(a, lambda t: t.replace(f'"store_id": "{sid}", ', "").replace('{"', '{"a_later_field": 1, "', 1))
    with StoreReader(a) as r:
        assert r.meta.store_id == "" and len(r) == 300
        np.testing.assert_array_equal(r.read_batch([0, 299]), x[[0, 299]])
        assert "store_id" not in r.meta.to_json().decode()
    for bad in ('"store_id": 7', '"store_id": "xyz"'):
        raw = StoreMeta(shape=(2,), dtype="<f4", classes=["a"], samples_per_value=1).to_json().decode()
        with pytest.raises(LmdbStoreError, match="store_id"):
            StoreMeta.from_json(raw.replace('{"', "{" + bad + ', "', 1).encode())


def _epoch(path: Path, x: np.ndarray, context: str = "fork") -> None:
    ds = LmdbBatchDataset(path)
    sampler = EpochBatchSampler(np.arange(len(ds)), 128, shuffle="random", seed=2)
    loader = make_loader(ds, sampler, LoaderConfig(workers=2, multiprocessing_context=context))
    for (xb, _), idx in zip(loader, sampler.batches(), strict=True):
        np.testing.assert_array_equal(xb[:, 0].numpy(), x[idx])


def test_a_writer_open_in_the_parent_with_forked_workers(tmp_path: Path) -> None:
    """Forked workers used to inherit the writer's environment and fail to open their own ("already open
    in this process"); they now read, and the writer goes on committing."""
    x, y = make_data(1500, seed=10)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    with open_writer(path, config=CFG) as w:
        _epoch(path, x)
        w.append(np.zeros((10, 25, 25), np.float32), 0)
        w.commit()
    with StoreReader(path) as r:
        assert len(r) == 1510


def test_a_registered_reader_in_the_parent_keeps_its_slot_across_forks(tmp_path: Path) -> None:
    """A child closing an inherited environment used to abort the parent's read transaction in the shared
    reader table: the parent's snapshot lost its protection and later commits overwrote it."""
    x, y = make_data(2000, seed=11)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    r = StoreReader(path, lock=True)
    np.testing.assert_array_equal(r.read_batch(np.arange(2000)), x)
    pid = os.getpid()
    _epoch(path, x)  # forked workers open (and at exit drop) their own environments
    readers = r._handle().env.readers()
    assert str(pid) in readers
    p = _writer(path, 60)
    assert p.wait(60) == 0
    assert r._handle().protected() and len(r) == 2000
    np.testing.assert_array_equal(r.read_batch(np.arange(2000)), x)
    r.close()


def test_window_training_beside_a_writer(tmp_path: Path) -> None:
    from lmdbstore import TrainConfig, train

    x, y = make_data(3000, seed=12)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    p = _writer(path, 40, wait=True)
    lcfg = LoaderConfig(batch_size=256, workers=2, shuffle="window", window_mb=1, multiprocessing_context="fork")
    cfg = TrainConfig(epochs=2, width=4, max_steps_per_epoch=3, device="cpu")
    result = train(path, tmp_path / "run", cfg, lcfg, progress=False, log=None)
    _go(p)
    assert result is not None


def test_truncated_under_an_open_reader_is_one_line_never_sigbus(tmp_path: Path) -> None:
    x, y = make_data(3000, seed=13)
    path = build_store(tmp_path / "s", x, y, config=CFG)
    script = textwrap.dedent(
        f"""
        import os, shutil, sys, numpy as np
        from lmdbstore import StoreReader, LmdbStoreError
        from lmdbstore.tools.verify import verify_store
        from lmdbstore.tools.export import select_indices
        path = {str(path)!r}
        calls = {{
            "labels": lambda r: r.labels(), "class_indices": lambda r: r.class_indices(1),
            "iter_raw": lambda r: list(r.iter_raw(b"samples")),
            "read_range": lambda r: r.read_range(0, 3000), "read_batch": lambda r: r.read_batch(np.arange(3000)),
            "verify": lambda r: verify_store(r), "select": lambda r: select_indices(r, split="val"),
        }}
        size = os.path.getsize(path + "/data.mdb")
        shutil.copyfile(path + "/data.mdb", path + "/../pristine")
        for name, call in calls.items():
            for positions in (True, False):
                r = StoreReader(path, positions=positions).open()
                os.truncate(path + "/data.mdb", size // 3)
                try:
                    got = call(r)
                    if name == "verify" and not got.ok:  # verify reports damage instead of raising
                        raise LmdbStoreError(got.problems[0].message if got.problems else "not ok")
                    print(name, "no error")
                except LmdbStoreError as exc:
                    print(name, "error", "\\n" in str(exc))
                r.close()
                shutil.copyfile(path + "/../pristine", path + "/data.mdb")
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")
    assert len([ln for ln in lines if ln]) == 14
    assert all(ln.endswith("error False") for ln in lines if ln), res.stdout
