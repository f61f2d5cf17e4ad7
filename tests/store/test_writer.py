"""The writer: exact round trips, packing on disk, appends and resumes, validation, locking, map growth."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import (
    CLASSES,
    HALF_CREATED,
    StoreInfo,
    build_store,
    dir_bytes,
    half_created,
    make_data,
    raw_env,
    snapshot_store,
)

from lmdbstore import (
    CorruptStoreError,
    LmdbStoreError,
    NotAStoreError,
    StoreExistsError,
    StoreFullError,
    StoreLockedError,
    StoreMeta,
    StoreReader,
    ValidationError,
    WriterConfig,
    open_writer,
)
from lmdbstore.format.layout import DB_META, DB_SAMPLES, META_KEY, decode_key
from lmdbstore.format.packing import choose_samples_per_value
from lmdbstore.format.value_stats import ValueStats
from lmdbstore.tools.verify import verify_store

FAST = WriterConfig(sync=False)


def read_everything(path: Path) -> tuple[np.ndarray, np.ndarray, StoreMeta]:
    """All samples, labels and the metadata of a store (the reader is closed again)."""
    with StoreReader(path) as r:
        return r.read_range(0, len(r)), r.labels().copy(), r.meta


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_value_layout(path: Path) -> None:
    """Every value is keyed by a multiple of samples_per_value and has exactly the expected length."""
    with StoreReader(path) as r:
        m = r.meta
        keys = []
        for k, v in r.iter_raw(DB_SAMPLES):
            first = decode_key(k)
            keys.append(first)
            assert len(v) == m.expected_value_len(first)
        assert keys == list(range(0, m.count, m.samples_per_value))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("spv", [None, 7])
@pytest.mark.parametrize("shape", [(25, 25), (3, 8, 8), (7,)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.int64])
def test_round_trip_bit_for_bit(tmp_path: Path, dtype: type, shape: tuple[int, ...], spv: int | None) -> None:
    n = 150
    x, y = make_data(n, seed=3, shape=shape, dtype=dtype)
    if np.dtype(dtype).kind == "f":
        x.reshape(n, -1)[:, -1] = -0.0  # signed zeros must survive too
    path = build_store(tmp_path / "s", x, y, config=WriterConfig(samples_per_value=spv, sync=False), batch=61)
    with StoreReader(path) as r:
        m = r.meta
        assert (len(r), r.shape, r.dtype) == (n, shape, np.dtype(dtype))
        want_spv = spv or choose_samples_per_value(m.sample_bytes, 4)
        assert m.samples_per_value == want_spv
        assert same_bits(r.read_range(0, n), x)
        assert same_bits(r.read_range(5, 100), x[5:100])
        perm = np.random.default_rng(0).permutation(n)
        assert same_bits(r.read_batch(perm), x[perm])
        assert same_bits(r.read(n - 1), x[n - 1])
        chunks = list(r.iter_chunks(chunk=40))
        assert [c[0] for c in chunks] == [0, 40, 80, 120]
        assert same_bits(np.concatenate([c[1] for c in chunks]), x)
        np.testing.assert_array_equal(np.concatenate([c[2] for c in chunks]), y)
        np.testing.assert_array_equal(r.labels(), y)
    check_value_layout(path)


def test_disk_overhead_of_reference_samples(store_factory: Callable[..., StoreInfo]) -> None:
    info = store_factory(18 * 200 + 5, config=FAST)
    with StoreReader(info.path) as r:
        st = r.env_stats()
        s = st["dbs"]["samples"]
        pages = s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        ratio = pages * st["psize"] / (len(r) * 2500)
    assert ratio <= 1.05, f"samples use {ratio:.3f}x their raw size"


# ----------------------------------------------------------------------------- appending and resuming


def test_odd_batches_commits_and_reopen_continue_indices(tmp_path: Path) -> None:
    path = tmp_path / "s"
    x, y = make_data(700, seed=5)
    sizes = [1, 17, 18, 19, 2, 35, 100, 7, 1, 0, 36, 64]
    cfg = WriterConfig(commit_bytes=9 * 2500, sync=False)  # auto-commits every few samples too
    pos = 0
    with open_writer(path, shape=(25, 25), dtype="float32", classes=CLASSES, config=cfg) as w:
        for i, k in enumerate(sizes):
            assert w.append(x[pos : pos + k], y[pos : pos + k]) == pos
            pos += k
            assert w.count == pos
            if i % 3 == 0:
                w.commit()
                assert w.committed == pos
    assert pos % 18 != 0  # the last value is partial
    check_value_layout(path)
    for round_ in range(3):  # reopen and append again, each time starting inside a partial value
        k = 23 + 11 * round_
        with open_writer(path, config=cfg) as w:
            assert w.committed == pos
            assert w.append(x[pos : pos + k], y[pos : pos + k]) == pos
            w.commit()
            assert w.append(x[pos + k : pos + k + 5], y[pos + k : pos + k + 5]) == pos + k
        pos += k + 5
        got_x, got_y, meta = read_everything(path)
        assert meta.count == pos
        assert same_bits(got_x, x[:pos])
        np.testing.assert_array_equal(got_y, y[:pos])
        assert meta.class_counts == np.bincount(y[:pos], minlength=5).tolist()
        check_value_layout(path)


def test_values_and_statistics_are_the_packing_of_each_commit(tmp_path: Path) -> None:
    """The bytes on disk, from the format's rule alone: value k holds samples k..k+spv-1 then their crc32, however the
    batches of a commit cut the values (batches spanning values, values spanning batches, a partial value continued
    by the next commit), with or without the writer's copy; each commit's statistics are those of its samples in
    order, as one array."""
    x, y = make_data(400, seed=9)
    commits = [[1, 17, 18, 19], [2, 35], [100, 7, 1], [36, 64, 3], [97]]
    path = tmp_path / "s"
    want = ValueStats()
    pos = 0
    with open_writer(path, shape=(25, 25), dtype="float32", classes=CLASSES, config=FAST) as w:
        for c, sizes in enumerate(commits):
            for k in sizes:
                w.append(x[pos : pos + k].copy(), y[pos : pos + k], copy=bool(c % 2))
                pos += k
            w.commit()
            done = ValueStats(**vars(want))
            done.update(x[pos - sum(sizes) : pos])
            want = done
    spv = 18
    with StoreReader(path) as r:
        values = {decode_key(k): bytes(v) for k, v in r.iter_raw(DB_SAMPLES)}
        assert r.meta.value_stats == want
    assert sorted(values) == list(range(0, pos, spv))
    for first, value in values.items():
        payload = x[first : first + spv].tobytes()
        assert value == payload + zlib.crc32(payload).to_bytes(4, "little"), first


def test_append_without_copy_keeps_the_array_given_until_the_commit(tmp_path: Path) -> None:
    """copy=False hands the array over: the writer writes what it holds at the commit (write_parallel passes
    results nobody else holds); the default copies (see the next test)."""
    buf = np.zeros((5, 25, 25), np.float32)
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES) as w:
        w.append(buf, [0] * 5, copy=False)
        buf[:] = 7
    with StoreReader(tmp_path / "s") as r:
        assert np.all(r.read_range(0, 5) == 7)


def test_appending_single_samples_and_reopening_each_time(tmp_path: Path) -> None:
    path = tmp_path / "s"
    x, y = make_data(40, seed=6, shape=(3,), dtype=np.int64)
    for i in range(40):
        with open_writer(
            path, shape=(3,), dtype=np.int64, classes=CLASSES, config=WriterConfig(samples_per_value=6)
        ) as w:
            assert w.append(x[i], int(y[i])) == i  # one sample without the batch axis, one scalar label
    got_x, got_y, _ = read_everything(path)
    assert same_bits(got_x, x) and np.array_equal(got_y, y)
    check_value_layout(path)


@pytest.mark.parametrize(
    "make_labels",
    [
        lambda y: y.tolist(),
        lambda y: y.astype(np.uint8),
        lambda y: [CLASSES[i] for i in y],
        lambda y: np.array([CLASSES[i] for i in y]),
        lambda y: np.array([CLASSES[i].encode() for i in y]),
    ],
    ids=["int-list", "uint8-array", "name-list", "str-array", "bytes-array"],
)
def test_labels_as_ids_or_names(tmp_path: Path, make_labels: Callable[[np.ndarray], object]) -> None:
    x, y = make_data(50, seed=7)
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES, config=FAST) as w:
        w.append(x, make_labels(y))
    _, got, meta = read_everything(tmp_path / "s")
    np.testing.assert_array_equal(got, y)
    assert meta.class_counts == np.bincount(y, minlength=5).tolist()


@pytest.mark.parametrize("label", [3, np.int64(3), np.uint8(3), "d"])
def test_one_label_for_the_whole_batch(tmp_path: Path, label: object) -> None:
    x, _ = make_data(10, seed=8)
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES, config=FAST) as w:
        w.append(x, label)
    _, got, meta = read_everything(tmp_path / "s")
    assert got.tolist() == [3] * 10
    assert meta.class_counts == [0, 0, 0, 10, 0]


def _check_class_index(path: Path, y: np.ndarray) -> None:
    with StoreReader(path) as r:
        np.testing.assert_array_equal(r.labels(), y)
        assert r.meta.class_counts == np.bincount(y, minlength=5).tolist()
        for c in range(5):
            got = r.class_indices(c)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, np.flatnonzero(y == c))


def _set_label_chunk(path: Path, chunk: int) -> None:
    """Rewrite an empty store's metadata with a tiny label chunk (a valid, if unusual, store)."""
    with raw_env(path) as env, env.begin(write=True) as txn:
        db = env.open_db(DB_META, txn=txn)
        meta = StoreMeta.from_json(txn.get(META_KEY, db=db))
        assert meta.count == 0
        txn.put(META_KEY, meta.with_(label_chunk=chunk).to_json(), db=db)


def test_class_index_across_small_label_chunks(tmp_path: Path) -> None:
    path = tmp_path / "s"
    x, y = make_data(420, seed=9, shape=(2,), dtype=np.uint8, p=[0.5, 0.2, 0.2, 0.1, 0.0])
    open_writer(path, shape=(2,), dtype=np.uint8, classes=CLASSES, config=FAST).close()
    _set_label_chunk(path, 7)
    pos = 0
    for k in [1, 5, 7, 8, 13, 14, 0, 50, 3, 98, 5, 200]:  # positions 2, 8, ..., 204, 210 (=30*7), 410
        with open_writer(path, config=FAST) as w:
            w.append(x[pos : pos + k], y[pos : pos + k])
            if k % 2:
                w.commit()
                w.append(x[pos + k : pos + k + 1], y[pos + k : pos + k + 1])
                k += 1
        pos += k
        _check_class_index(path, y[:pos])
    with StoreReader(path) as r:
        assert r.meta.label_chunk == 7
        assert same_bits(r.read_range(0, pos), x[:pos])


def test_class_index_across_default_label_chunks(tmp_path: Path) -> None:
    n = 140_000  # > 2 label chunks of 65,536; class "a" alone spans two class-index chunks
    x, y = make_data(n, seed=10, shape=(1,), dtype=np.uint8, p=[0.6, 0.1, 0.1, 0.1, 0.1])
    path = tmp_path / "s"
    cuts = [0, 1000, 65_535, 65_537, 100_000, 131_073, n]
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        kw = {"shape": (1,), "dtype": np.uint8, "classes": CLASSES} if i == 0 else {}
        with open_writer(path, config=FAST, **kw) as w:
            w.append(x[lo:hi], y[lo:hi])
    assert np.count_nonzero(y == 0) > 65_536
    _check_class_index(path, y)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda x, y: (x[:, :24], y), id="wrong-shape"),
        pytest.param(lambda x, y: (x.reshape(len(x), -1), y), id="flat-samples"),
        pytest.param(lambda x, y: (x[0, 0], 0), id="one-row"),
        pytest.param(lambda x, y: (x.astype(np.float64), y), id="float64"),
        pytest.param(lambda x, y: (x.astype(np.int32), y), id="int32"),
        pytest.param(lambda x, y: (x.astype(">f4"), y), id="big-endian-ok"),
        pytest.param(lambda x, y: (_with(x, 3, np.nan), y), id="nan"),
        pytest.param(lambda x, y: (_with(x, 0, np.inf), y), id="inf"),
        pytest.param(lambda x, y: (_with(x, 5, -np.inf), y), id="-inf"),
        pytest.param(lambda x, y: (x, _with(y, 2, 5)), id="label-5"),
        pytest.param(lambda x, y: (x, _with(y, 2, -1)), id="label-neg"),
        pytest.param(lambda x, y: (x, ["a", "b", "z", "c", "d", "e"]), id="unknown-name"),
        pytest.param(lambda x, y: (x, "zz"), id="unknown-scalar-name"),
        pytest.param(lambda x, y: (x, 9), id="scalar-out-of-range"),
        pytest.param(lambda x, y: (x, y[:-1]), id="labels-short"),
        pytest.param(lambda x, y: (x, np.concatenate([y, y])), id="labels-long"),
        pytest.param(lambda x, y: (x, y.reshape(2, 3)), id="labels-2d"),
        pytest.param(lambda x, y: (x, y.astype(np.float32)), id="labels-float"),
        pytest.param(lambda x, y: (x, [None] * 6), id="labels-none"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    small_store: StoreInfo, bad: Callable[[np.ndarray, np.ndarray], tuple[object, object]]
) -> None:
    x, y = make_data(6, seed=11)
    bx, by = bad(x, y)
    before = snapshot_store(small_store.path)
    with open_writer(small_store.path, config=FAST) as w:
        if isinstance(bx, np.ndarray) and bx.dtype == np.dtype(">f4"):
            w.append(bx, by)  # a byte order is not a different dtype: accepted and stored little-endian
            w.abort()
        else:
            with pytest.raises(ValidationError) as exc:
                w.append(bx, by)
            msg = str(exc.value)
            assert "\n" not in msg and str(small_store.path) in msg
            assert w.count == 2000
    assert snapshot_store(small_store.path) == before


def _with(a: np.ndarray, i: int, v: object) -> np.ndarray:
    a = a.copy()
    a.reshape(len(a), -1)[i, -1] = v
    return a


def test_bad_batch_is_dropped_whole_and_good_ones_kept(tmp_path: Path) -> None:
    x, y = make_data(30, seed=12)
    bad = _with(x[10:20], 9, np.nan)
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES, config=FAST) as w:
        w.append(x[:10], y[:10])
        with pytest.raises(ValidationError, match="sample 9"):
            w.append(bad, y[10:20])
        assert w.append(x[20:], y[20:]) == 10
    got_x, got_y, _ = read_everything(tmp_path / "s")
    assert same_bits(got_x, np.concatenate([x[:10], x[20:]]))
    np.testing.assert_array_equal(got_y, np.concatenate([y[:10], y[20:]]))


def test_cast_converts_when_the_kind_allows(tmp_path: Path) -> None:
    x, y = make_data(20, seed=13)
    x64 = x.astype(np.float64) + 1e-12
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES, config=FAST) as w:
        w.append(x64, y, cast=True)
        with pytest.raises(ValidationError, match="cast"):
            w.append(x64.astype(np.complex64), y, cast=True)
    got, _, _ = read_everything(tmp_path / "s")
    assert same_bits(got, x64.astype(np.float32))


def test_byte_order_is_normalised(tmp_path: Path) -> None:
    x, y = make_data(30, seed=31, shape=(4,), dtype=np.int64)
    with open_writer(tmp_path / "s", shape=(4,), dtype=">i8", classes=CLASSES, config=FAST) as w:
        assert w.meta.dtype == "<i8"
        w.append(x.astype(">i8"), y)
    got, _, _ = read_everything(tmp_path / "s")
    assert got.dtype == np.dtype("<i8")
    np.testing.assert_array_equal(got, x)


def test_create_in_an_existing_empty_directory(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    with open_writer(d, shape=(2,), dtype="uint8", classes=["x", "y"]) as w:
        w.append(np.ones((3, 2), np.uint8), "y")
    assert read_everything(d)[2].class_counts == [0, 3]


def test_non_contiguous_input(tmp_path: Path) -> None:
    x, y = make_data(40, seed=32)
    wide = np.repeat(x, 2, axis=2)[:, :, ::2]  # a strided view
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES, config=FAST) as w:
        w.append(wide[:20], y[:20])
        w.append(np.asfortranarray(x[20:]), y[20:])
    assert same_bits(read_everything(tmp_path / "s")[0], x)


def test_int_store_refuses_float_even_with_cast(tmp_path: Path) -> None:
    x, y = make_data(5, seed=14, shape=(4,), dtype=np.uint8)
    with open_writer(tmp_path / "s", shape=(4,), dtype=np.uint8, classes=CLASSES, config=FAST) as w:
        with pytest.raises(ValidationError):
            w.append(x.astype(np.float32), y, cast=True)
        with pytest.raises(ValidationError):
            w.append(x.astype(np.int64), y, cast=True)  # signed to unsigned is another kind
        w.append(x.astype(np.uint16), y, cast=True)  # same kind, values in range: allowed
        with pytest.raises(ValidationError, match="fit"):
            w.append(x.astype(np.uint16) + 200, y, cast=True)  # would wrap around
    got, _, _ = read_everything(tmp_path / "s")
    assert same_bits(got, x)


def test_allow_nonfinite_stores_nan_and_inf(tmp_path: Path) -> None:
    x, y = make_data(12, seed=15)
    x = _with(_with(x, 2, np.nan), 7, -np.inf)
    cfg = WriterConfig(allow_nonfinite=True, sync=False)
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES, config=cfg) as w:
        w.append(x, y)
    got, _, meta = read_everything(tmp_path / "s")
    assert same_bits(got, x)
    finite = x[np.isfinite(x)].astype(np.float64)
    assert meta.value_stats.nonfinite == 2
    assert meta.value_stats.n == finite.size
    assert meta.value_stats.mean == pytest.approx(finite.mean(), rel=1e-9, abs=1e-12)


# ----------------------------------------------------------------------------- opening


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shape": (25, 24)},
        {"shape": (625,)},
        {"dtype": "float64"},
        {"dtype": "uint8"},
        {"classes": CLASSES[::-1]},
        {"classes": CLASSES[:4]},
    ],
)
def test_reopen_with_different_parameters_is_refused(small_store: StoreInfo, kwargs: dict[str, object]) -> None:
    before = snapshot_store(small_store.path)
    with pytest.raises(StoreExistsError) as exc:
        open_writer(small_store.path, **kwargs)
    assert "\n" not in str(exc.value)
    assert snapshot_store(small_store.path) == before
    # the lock was released: a writer with matching (or omitted) parameters opens fine
    open_writer(small_store.path, shape=(25, 25), dtype=np.float32, classes=CLASSES).close()


def test_open_writer_on_things_that_are_not_stores(tmp_path: Path) -> None:
    f = tmp_path / "file.bin"
    f.write_bytes(b"hello")
    with pytest.raises(NotAStoreError):
        open_writer(f, shape=(25, 25), dtype="float32", classes=CLASSES)
    assert f.read_bytes() == b"hello"
    d = tmp_path / "dir"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    with pytest.raises(NotAStoreError):
        open_writer(d, shape=(25, 25), dtype="float32", classes=CLASSES)
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]  # nothing created inside
    e = tmp_path / "foreign-lmdb"
    e.mkdir()
    with raw_env(e) as env, env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    with pytest.raises(NotAStoreError):
        open_writer(e)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dtype": "float32", "classes": CLASSES},
        {"shape": (25, 25), "classes": CLASSES},
        {"shape": (25, 25), "dtype": "float32"},
        {"shape": (0, 25), "dtype": "float32", "classes": CLASSES},
        {"shape": (1, 1, 1, 1, 1), "dtype": "float32", "classes": CLASSES},
        {"shape": (25, 25), "dtype": "complex64", "classes": CLASSES},
        {"shape": (25, 25), "dtype": "object", "classes": CLASSES},
        {"shape": (25, 25), "dtype": "float32", "classes": ["a", "a"]},
        {"shape": (25, 25), "dtype": "float32", "classes": []},
    ],
)
def test_creating_needs_valid_parameters(tmp_path: Path, kwargs: dict[str, object]) -> None:
    path = tmp_path / "new"
    with pytest.raises(ValueError):
        open_writer(path, **kwargs)
    assert not path.exists()


def test_second_writer_is_locked_out(small_store: StoreInfo) -> None:
    with open_writer(small_store.path, config=FAST) as w:
        with pytest.raises(StoreLockedError) as exc:
            open_writer(small_store.path)
        assert "\n" not in str(exc.value)
        w.append(make_data(3, seed=16)[0], 0)
    with open_writer(small_store.path) as w:  # released on close
        assert w.committed == 2003


def test_writer_refuses_use_after_close(small_store: StoreInfo) -> None:
    w = open_writer(small_store.path)
    w.close()
    w.close()  # idempotent
    with pytest.raises(LmdbStoreError, match="closed"):
        w.append(make_data(1)[0], 0)


def test_exception_in_with_discards_only_uncommitted(tmp_path: Path) -> None:
    path = tmp_path / "s"
    x, y = make_data(100, seed=17)
    with (
        pytest.raises(RuntimeError, match="boom"),
        open_writer(path, shape=(25, 25), dtype="float32", classes=CLASSES, config=FAST) as w,
    ):
        w.append(x[:40], y[:40], progress=("src", 40))
        w.commit()
        w.append(x[40:], y[40:], progress=("src", 100))
        raise RuntimeError("boom")
    got_x, got_y, meta = read_everything(path)
    assert meta.count == 40 and same_bits(got_x, x[:40]) and np.array_equal(got_y, y[:40])
    with open_writer(path) as w:
        assert w.progress("src") == 40
        assert w.count == 40


def test_abort_and_close_without_commit(small_store: StoreInfo) -> None:
    before = snapshot_store(small_store.path)
    x, y = make_data(5, seed=18)
    w = open_writer(small_store.path)
    w.append(x, y)
    w.abort()
    assert w.count == 2000
    w.append(x, y)
    w.close(commit=False)
    assert snapshot_store(small_store.path) == before


# ----------------------------------------------------------------------------- map size


def test_map_grows_from_one_mebibyte(tmp_path: Path) -> None:
    x, y = make_data(8000, seed=19)  # 20 MB
    cfg = WriterConfig(initial_map_size=1 << 20, sync=False, commit_bytes=12_000_000)
    path = build_store(tmp_path / "s", x, y, config=cfg, batch=3000)
    got_x, got_y, meta = read_everything(path)
    assert meta.count == 8000 and same_bits(got_x, x) and np.array_equal(got_y, y)
    with StoreReader(path) as r:
        assert r.env_stats()["info"]["map_size"] >= 20_000_000


def test_map_limit_gives_store_full_and_keeps_earlier_commits(tmp_path: Path) -> None:
    path = tmp_path / "s"
    x, y = make_data(2000, seed=20)
    cfg = WriterConfig(initial_map_size=1 << 20, max_map_size=3 << 20, sync=False)
    with (
        pytest.raises(StoreFullError) as exc,
        open_writer(path, shape=(25, 25), dtype="float32", classes=CLASSES, config=cfg) as w,
    ):
        w.append(x[:200], y[:200], progress=("src", 200))
        w.commit()
        w.append(x[200:], y[200:], progress=("src", 2000))  # 4.5 MB more: cannot fit in 3 MiB
        w.commit()
    assert "\n" not in str(exc.value) and exc.value.hint
    got_x, got_y, meta = read_everything(path)
    assert meta.count == 200 and same_bits(got_x, x[:200]) and np.array_equal(got_y, y[:200])
    with open_writer(path, config=cfg) as w:
        assert w.progress("src") == 200
        w.append(x[200:400], y[200:400])  # still room for a little more
    assert read_everything(path)[2].count == 400


def test_auto_commit_raises_store_full_from_append(tmp_path: Path) -> None:
    x, y = make_data(2000, seed=21)
    cfg = WriterConfig(initial_map_size=1 << 20, max_map_size=1 << 20, sync=False, commit_bytes=100_000)
    w = open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES, config=cfg)
    with pytest.raises(StoreFullError):
        for lo in range(0, 2000, 50):
            w.append(x[lo : lo + 50], y[lo : lo + 50])
    committed = w.committed
    assert 0 < committed < 2000
    w.close(commit=False)
    got_x, _, meta = read_everything(tmp_path / "s")
    assert meta.count == committed and same_bits(got_x, x[:committed])


# ----------------------------------------------------------------------------- statistics and ledger


def test_value_stats_match_numpy(tmp_path: Path) -> None:
    x, y = make_data(1000, seed=22)
    x = x * 2.5 + 0.75
    path = build_store(tmp_path / "s", x, y, config=FAST, batch=333)
    with open_writer(path, config=FAST) as w:  # a reopened writer continues the statistics
        more = make_data(77, seed=23)[0]
        w.append(more, 1)
    stats = read_everything(path)[2].value_stats
    allx = np.concatenate([x, more]).astype(np.float64)
    assert stats.n == allx.size and stats.nonfinite == 0
    assert stats.mean == pytest.approx(allx.mean(), rel=1e-9)
    assert stats.std == pytest.approx(allx.std(), rel=1e-9)
    assert stats.min == allx.min() and stats.max == allx.max()


def test_huge_finite_values_commit_with_finite_statistics(tmp_path: Path) -> None:
    # float64 values above ~1e154 used to overflow the sum of squares: half the data committed, then a
    # "not JSON compliant" error without a path on this and every later run
    x, y = make_data(400, seed=25, dtype=np.float64)
    x *= 1e300
    x[7, 3, 3] = np.finfo(np.float64).max
    path = build_store(tmp_path / "s", x, y, config=FAST, batch=100)
    meta = read_everything(path)[2]
    stats = meta.value_stats
    assert meta.count == 400 and stats.n == x.size
    scaled = x / 1e300
    assert stats.mean == pytest.approx(scaled.mean() * 1e300, rel=1e-9)
    assert stats.std == pytest.approx(scaled.std() * 1e300, rel=1e-9)
    assert stats.max == np.finfo(np.float64).max
    assert verify_store(path).ok


def test_progress_ledger_is_committed_with_the_samples(tmp_path: Path) -> None:
    path = tmp_path / "s"
    x, y = make_data(300, seed=24)
    cfg = WriterConfig(commit_bytes=25 * 2500, sync=False)
    with open_writer(path, shape=(25, 25), dtype="float32", classes=CLASSES, config=cfg) as w:
        assert w.progress("src") == 0
        for lo in range(0, 300, 10):
            w.append(x[lo : lo + 10], y[lo : lo + 10], progress=("src", lo + 10), progress_total=300)
            # whatever the auto-commits did, the ledger and the committed samples agree
            assert w.progress("src") == w.committed
        w.append(x[:0], y[:0], progress=("other", 7))
        assert w.progress("other") == 0
        w.commit()
        assert w.progress("other") == 7
        entries = w.progress_entries()
    assert entries["src"] == {"done": 300, "total": 300}
    assert entries["other"]["done"] == 7
    with raw_env(path, readonly=True) as env, env.begin() as txn:
        raw = txn.get(b"src", db=env.open_db(b"progress", txn=txn, create=False))
    assert json.loads(raw)["done"] == 300  # JSON, not pickle


def test_append_copies_a_buffer_the_caller_reuses(tmp_path: Path) -> None:
    """Appends are buffered until the commit; refilling the same array must not change what was appended."""
    buf = np.zeros((5, 25, 25), np.float32)
    with open_writer(tmp_path / "s", shape=(25, 25), dtype="float32", classes=CLASSES) as w:
        for i in range(3):
            buf[:] = i
            w.append(buf, [0] * 5)
    with StoreReader(tmp_path / "s") as r:
        got = r.read_range(0, 15)
    assert [float(got[5 * i].flat[0]) for i in range(3)] == [0.0, 1.0, 2.0]


# ------------------------------------------------------------------------- a creation interrupted before its first commit

NEW = {"shape": (25, 25), "dtype": "float32", "classes": CLASSES}


def _interrupted_error(exc: pytest.ExceptionInfo[NotAStoreError], path: Path) -> None:
    text = str(exc.value)
    assert "\n" not in text and str(path) in text
    assert "creation was interrupted" in text and "rerun the ingest" in text and "shape, dtype and classes" in text


@pytest.mark.parametrize("state", HALF_CREATED)
def test_interrupted_creation_is_created_afresh(tmp_path: Path, state: str) -> None:
    path = half_created(tmp_path / "store", state)
    before = dir_bytes(path)
    with pytest.raises(NotAStoreError) as exc:
        StoreReader(path).open()
    _interrupted_error(exc, path)
    with pytest.raises(NotAStoreError) as exc:  # a writer without the parameters cannot complete it
        open_writer(path)
    _interrupted_error(exc, path)
    assert dir_bytes(path) == before
    x, y = make_data(300, 7)
    with open_writer(path, **NEW, config=FAST) as w:
        assert w.count == 0
        w.append(x, y)
    report = verify_store(path)
    assert report.ok, [str(p) for p in report.problems]
    got_x, got_y, meta = read_everything(path)
    assert np.array_equal(got_x, x) and np.array_equal(got_y, y) and meta.count == 300
    with open_writer(path, **NEW) as w:  # and it is an ordinary store from now on
        assert w.count == 300


def test_interrupted_creation_still_running_elsewhere_is_locked_not_destroyed(tmp_path: Path) -> None:
    path = half_created(tmp_path / "store", "empty_env")
    before = dir_bytes(path)
    fd = os.open(path / "writer.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what the creating writer holds until it returns
        with pytest.raises(StoreLockedError):
            open_writer(path, **NEW)
        assert dir_bytes(path) == before
    finally:
        os.close(fd)
    open_writer(path, **NEW).close()
    assert verify_store(path).ok


def _with_extra_file(path: Path) -> None:
    half_created(path, "empty_env")
    (path / "notes.txt").write_text("mine")


def _with_main_key(path: Path) -> None:
    half_created(path, "lock_only")
    with raw_env(path) as env, env.begin(write=True) as txn:
        txn.put(b"k", b"v")


def _with_empty_subdb(path: Path) -> None:
    half_created(path, "lock_only")
    with raw_env(path) as env, env.begin(write=True) as txn:
        env.open_db(b"things", txn=txn)


def _with_short_data(path: Path) -> None:
    half_created(path, "lock_only")
    (path / "data.mdb").write_bytes(b"\0" * 100)


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (_with_extra_file, NotAStoreError),
        (_with_main_key, NotAStoreError),
        (_with_empty_subdb, NotAStoreError),
        (_with_short_data, CorruptStoreError),
    ],
)
def test_what_an_interrupted_creation_cannot_leave_is_refused_and_untouched(
    tmp_path: Path, make: Callable[[Path], None], error: type[LmdbStoreError]
) -> None:
    path = tmp_path / "store"
    make(path)
    before = dir_bytes(path)
    before.pop("lock.mdb", None)  # LMDB's reader table: opening a foreign environment (as before) rewrites it
    for fn in (lambda: open_writer(path, **NEW), lambda: open_writer(path), lambda: StoreReader(path).open()):
        with pytest.raises(error) as exc:
            fn()
        assert "creation was interrupted" not in str(exc.value)
        after = dir_bytes(path)
        after.pop("lock.mdb", None)
        assert after == before


@pytest.mark.parametrize(
    "progress, total",
    [(("src", -5), None), (("src", 2.5), None), (("src", "7"), None), (("src", True), None), (("src", 2**70), None),
     (("", 5), None), ((b"src", 5), None), (("x" * 600, 5), None), ("src", None), (("src", 5), -1), (("src", 5), 1.5),
     (None, 10)],
)  # fmt: skip
def test_every_number_the_ledger_records_is_checked_before_anything_is_kept(
    small_store: StoreInfo, progress: Any, total: Any
) -> None:
    """Issue 25 #9: a bad position used to be committed (and the store then failed its own ledger check)."""
    before = snapshot_store(small_store.path)
    x, y = make_data(20, seed=3)
    with open_writer(small_store.path) as w:
        with pytest.raises(ValueError, match="progress") as exc:
            w.append(x, y, progress=progress, progress_total=total)
        assert "\n" not in str(exc.value) and w.count == 2000
        w.append(x, y, progress=("src", np.int64(20)), progress_total=np.uint32(40))  # numpy integers are integers
        assert w.count == 2020
    after = snapshot_store(small_store.path)
    assert after[b"progress"] == {b"src": b'{"done": 20, "total": 40}'} and before[b"progress"] == {}


def test_commit_bytes_beyond_the_machine_is_clipped(tmp_path: Path) -> None:
    """``commit_bytes=10**15`` buffered every sample until the end (issue 34, memory): the writer buffers at most half
    the available memory, says so naming the parameter, and commits when that much is pending."""
    import warnings

    from lmdbstore.util.memory import MemoryBoundWarning, available_memory

    x, y = make_data(100, seed=3)
    with pytest.warns(MemoryBoundWarning, match="commit_bytes: samples buffered before a commit"):
        w = open_writer(
            tmp_path / "s",
            shape=(25, 25),
            dtype="float32",
            classes=CLASSES,
            config=WriterConfig(commit_bytes=10**15, sync=False),
        )
    with w:
        assert w._commit_bytes <= available_memory()
        w.append(x, y)
        assert w.committed == 0  # 250 KB pending: far below the bound
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_writer(tmp_path / "s", config=WriterConfig(commit_bytes=1, sync=False)) as w:
            w.append(x[:3], y[:3])
            assert w.committed == 103  # a commit as soon as a byte is pending
