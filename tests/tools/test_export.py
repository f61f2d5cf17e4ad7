"""export_store (npy/npz/HDF5, selections, streaming, atomic output) and copy_store (consistent copies)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, StoreInfo, snapshot_store

from lmdbstore import LmdbStoreError, StoreExistsError, open_reader
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources
from lmdbstore.loader.samplers import stratified_split
from lmdbstore.tools.copy import copy_store
from lmdbstore.tools.export import export_store, load_indices
from lmdbstore.tools.export_formats import export_paths
from lmdbstore.tools.verify import verify_store


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_export_round_trips_bit_for_bit_through_ingest(small_store: StoreInfo, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"all{suffix}"
    rep = export_store(small_store.path, out, chunk=300)  # several chunks, last one partial
    assert rep.samples == 2000 and rep.classes == CLASSES and rep.files == [str(out)]
    new = tmp_path / "again"
    ingest(new, open_sources([out]))
    with open_reader(new) as r:
        assert r.classes == CLASSES
        assert np.array_equal(_bits(r.read_range(0, len(r))), _bits(small_store.x))
        assert np.array_equal(r.labels(), small_store.y)
    assert verify_store(new).ok


def test_npy_export_writes_samples_labels_and_class_names(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "x.npy"
    rep = export_store(small_store.path, out, classes=["c"])
    paths = export_paths(out)
    assert rep.files == [str(p) for p in paths]
    assert [p.name for p in paths] == ["x.npy", "x.labels.npy", "x.classes.json"]
    keep = small_store.y == 2
    assert np.array_equal(_bits(np.load(out)), _bits(small_store.x[keep]))
    assert np.array_equal(np.load(paths[1]), np.zeros(int(keep.sum())))
    assert json.loads(paths[2].read_text()) == ["c"]
    # a single-class .npy ingests again with --label
    ingest(tmp_path / "c_only", open_sources([out], label="c"))
    with open_reader(tmp_path / "c_only") as r:
        assert r.classes == ["c"] and np.array_equal(_bits(r.read_range(0, len(r))), _bits(small_store.x[keep]))


def test_class_selection_renumbers_ids(small_store: StoreInfo, tmp_path: Path) -> None:
    out = tmp_path / "be.npz"
    rep = export_store(small_store.path, out, classes=["e", "b"])
    assert rep.classes == ["b", "e"]
    with np.load(out) as z:
        keep = np.isin(small_store.y, [1, 4])
        assert list(z["class_names"]) == ["b", "e"]
        assert np.array_equal(z["y"], (small_store.y[keep] == 4).astype(np.int64))
        assert np.array_equal(_bits(z["x"]), _bits(small_store.x[keep]))


def test_split_matches_training_split(small_store: StoreInfo, tmp_path: Path) -> None:
    train_idx, val_idx = stratified_split(small_store.y, 0.2, seed=7)
    for split, want in (("train", train_idx), ("val", val_idx)):
        out = tmp_path / f"{split}.npz"
        rep = export_store(small_store.path, out, split=split, val_fraction=0.2, seed=7)
        assert rep.samples == len(want)
        with np.load(out) as z:
            assert np.array_equal(_bits(z["x"]), _bits(small_store.x[want]))
    assert len(train_idx) + len(val_idx) == 2000


def test_indices_keep_their_order_and_combine_with_classes(small_store: StoreInfo, tmp_path: Path) -> None:
    idx = np.array([1999, 5, 17, 5, 0])
    np.savetxt(tmp_path / "idx.txt", idx, fmt="%d")
    np.save(tmp_path / "idx.npy", idx)
    for f in ("idx.txt", "idx.npy"):
        assert np.array_equal(load_indices(tmp_path / f), idx)
    export_store(small_store.path, tmp_path / "i.npz", indices=load_indices(tmp_path / "idx.txt"))
    with np.load(tmp_path / "i.npz") as z:
        assert np.array_equal(_bits(z["x"]), _bits(small_store.x[idx]))
    cls = int(small_store.y[17])
    export_store(small_store.path, tmp_path / "j.npz", indices=idx, classes=[CLASSES[cls]])
    with np.load(tmp_path / "j.npz") as z:
        assert np.array_equal(_bits(z["x"]), _bits(small_store.x[idx[small_store.y[idx] == cls]]))


def test_bad_selections_and_outputs_write_nothing(small_store: StoreInfo, tmp_path: Path) -> None:
    before = snapshot_store(small_store.path)
    with pytest.raises(IndexError, match="2000"):
        export_store(small_store.path, tmp_path / "a.npz", indices=[0, 2000])
    with pytest.raises(ValueError, match="unknown class 'zz'"):
        export_store(small_store.path, tmp_path / "a.npz", classes=["zz"])
    with pytest.raises(ValueError, match="split"):
        export_store(small_store.path, tmp_path / "a.npz", split="test")
    with pytest.raises(ValueError, match="cannot tell the format"):
        export_store(small_store.path, tmp_path / "a.csv")
    (tmp_path / "bad.txt").write_text("1\nnot-a-number\n")
    with pytest.raises(ValueError, match="indices"):
        load_indices(tmp_path / "bad.txt")
    assert list(tmp_path.glob("a.*")) == [] and list(tmp_path.glob(".*part*")) == []
    (tmp_path / "b.npz").write_bytes(b"keep me")
    with pytest.raises(StoreExistsError):
        export_store(small_store.path, tmp_path / "b.npz")
    assert (tmp_path / "b.npz").read_bytes() == b"keep me"
    export_store(small_store.path, tmp_path / "b.npz", overwrite=True)
    with np.load(tmp_path / "b.npz") as z:
        assert len(z["x"]) == 2000
    assert snapshot_store(small_store.path) == before


def test_indices_are_sample_numbers_only(small_store: StoreInfo, tmp_path: Path) -> None:
    """Issue 39: the reader's index rule for indices= and the --indices file: no mask, no floats, never cast."""
    mask = np.zeros(2000, bool)
    mask[[5, 7]] = True
    for bad, want in [(mask, "boolean mask"), ([10.7, 20.2], "integer sample indices")]:
        with pytest.raises(ValueError, match=want):
            export_store(small_store.path, tmp_path / "a.npz", indices=bad)
        np.save(tmp_path / "bad.npy", np.asarray(bad))
        with pytest.raises(ValueError, match=want):
            load_indices(tmp_path / "bad.npy")
    assert list(tmp_path.glob("a.*")) == []


def test_export_memory_stays_at_one_chunk(store_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    info = store_factory(20000, seed=3)  # 50 MB of samples
    tracemalloc.start()
    try:
        export_store(info.path, tmp_path / "big.npz", chunk=1000)  # 2.5 MB per chunk
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak
    with np.load(tmp_path / "big.npz") as z:
        assert np.array_equal(_bits(z["x"]), _bits(info.x))


def test_copy_and_compact_copy_verify_clean(small_store: StoreInfo, tmp_path: Path) -> None:
    for compact in (False, True):
        dest = tmp_path / f"copy{compact}"
        rep = copy_store(small_store.path, dest, compact=compact)
        assert rep.samples == 2000 and rep.dest_bytes > 0
        assert verify_store(dest).ok
        copied, source = snapshot_store(dest), snapshot_store(small_store.path)
        meta_c, meta_s = (json.loads(s.pop(b"meta")[b"meta"]) for s in (copied, source))
        assert meta_c.pop("store_id") != meta_s.pop("store_id")  # the copy is another store: its own id
        assert copied == source and meta_c == meta_s
    with pytest.raises(StoreExistsError):
        copy_store(small_store.path, tmp_path / "copyTrue")
    with pytest.raises(LmdbStoreError, match="no such store"):
        copy_store(tmp_path / "nope", tmp_path / "x")
    r = open_reader(small_store.path, lock=False)  # this process's environment of the store: shared by the copy
    first = r.read_batch([0, 1999])
    copy_store(small_store.path, tmp_path / "y")
    assert verify_store(tmp_path / "y").ok and not list(tmp_path.glob(".y.copy-*"))
    np.testing.assert_array_equal(r.read_batch([0, 1999]), first)  # the reader goes on
    r.close()


def test_copy_while_a_writer_appends_is_consistent(small_store: StoreInfo, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, numpy as np
        from lmdbstore import open_writer
        with open_writer({str(small_store.path)!r}) as w:
            print("ready", flush=True)
            rng = np.random.default_rng(0)
            for i in range(200):
                w.append(rng.standard_normal((500, 25, 25)).astype("float32"), rng.integers(0, 5, 500))
                w.commit()
        """
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        reps = [copy_store(small_store.path, tmp_path / f"c{i}") for i in range(3)]
    finally:
        p.wait(timeout=300)
    assert p.returncode == 0
    for rep in reps:
        rpt = verify_store(rep.dest)
        assert rpt.ok, rpt.problems
        assert (rep.samples - 2000) % 500 == 0
        with open_reader(rep.dest) as r:
            assert len(r) == rep.samples
            assert np.array_equal(_bits(r.read_range(0, 2000)), _bits(small_store.x))


def test_a_chunk_larger_than_the_data_costs_what_the_data_needs(small_store: StoreInfo, tmp_path: Path) -> None:
    """``chunk=10**12`` (issue 34, memory): one chunk of the 2,000 samples selected, not 10**12 rows; no warning on a
    machine that holds them; the export exact."""
    import warnings

    out = tmp_path / "all.npy"
    tracemalloc.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_store(small_store.path, out, chunk=10**12)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20
    np.testing.assert_array_equal(np.load(out), small_store.x)
