"""The on-disk format: value packing, key encoding, checksums and the metadata JSON schema."""

from __future__ import annotations

import json
import math
import struct
import zlib

import numpy as np
import pytest

from lmdbstore import CorruptStoreError, FormatVersionError, StoreMeta
from lmdbstore.format.checksums import checksum_size, compute_checksum
from lmdbstore.format.dtypes import label_dtype_for
from lmdbstore.format.layout import FORMAT_VERSION, classidx_key, decode_key, encode_key
from lmdbstore.format.packing import _value_cost, choose_samples_per_value
from lmdbstore.format.value_stats import ValueStats

# ----------------------------------------------------------------------------- packing


def test_reference_sample_packs_18_per_value() -> None:
    spv = choose_samples_per_value(2500, trailer_bytes=4)
    assert spv == 18
    ratio = _value_cost(spv * 2500 + 4, 4096) / (spv * 2500)
    assert ratio <= 1.005
    # one sample per key would waste most of an overflow page
    assert _value_cost(2500 + 4, 4096) / 2500 > 1.6


@pytest.mark.parametrize("trailer", [0, 4, 8])
@pytest.mark.parametrize(
    "sample_bytes", [1, 2, 3, 7, 50, 100, 1000, 2000, 2048, 2500, 3000, 4096, 5000, 8192, 65536, 100_000, 300_000]
)
def test_packing_overhead_is_small(sample_bytes: int, trailer: int) -> None:
    spv = choose_samples_per_value(sample_bytes, trailer_bytes=trailer)
    assert spv >= 1
    ratio = _value_cost(spv * sample_bytes + trailer, 4096) / (spv * sample_bytes)
    assert ratio <= 1.05
    # never a value above the cap, unless a single sample is larger than the cap
    assert spv == 1 or spv * sample_bytes + trailer <= 256 * 1024
    # the count is the smallest one within tolerance when the tolerance can be met
    if ratio <= 1.005:
        for smaller in range(1, spv):
            assert _value_cost(smaller * sample_bytes + trailer, 4096) / (smaller * sample_bytes) > 1.005


def test_packing_respects_max_value_bytes() -> None:
    spv = choose_samples_per_value(2500, 4, max_value_bytes=20_000)
    assert spv >= 1 and spv * 2500 + 4 <= 20_000


def test_packing_rejects_nonpositive_sample_size() -> None:
    with pytest.raises(ValueError, match="sample_bytes"):
        choose_samples_per_value(0)


# ----------------------------------------------------------------------------- keys and checksums


def test_key_order_is_index_order() -> None:
    rng = np.random.default_rng(0)
    idx = [0, 1, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**48, *rng.integers(0, 2**50, 200).tolist()]
    keys = [encode_key(i) for i in idx]
    assert all(len(k) == 8 for k in keys)
    assert sorted(keys) == [encode_key(i) for i in sorted(idx)]
    assert [decode_key(k) for k in keys] == idx


def test_decode_key_rejects_wrong_width() -> None:
    with pytest.raises(CorruptStoreError):
        decode_key(b"\x00" * 7)


def test_classidx_keys_sort_by_class_then_position() -> None:
    pairs = [(c, p) for c in (0, 1, 300) for p in (0, 65536, 2**40)]
    keys = [classidx_key(c, p) for c, p in pairs]
    assert sorted(keys) == keys


def test_checksums() -> None:
    data = b"lmdbstore" * 100
    crc = compute_checksum("crc32")
    assert crc is not None and crc(data) == struct.pack("<I", zlib.crc32(data))
    assert crc(memoryview(data)) == crc(data)
    assert compute_checksum("none") is None
    xxh = compute_checksum("xxh64")
    assert xxh is not None
    xxhash = pytest.importorskip("xxhash")
    assert xxh(data) == xxhash.xxh64_intdigest(data).to_bytes(8, "little")
    assert [checksum_size(k) for k in ("none", "crc32", "xxh64")] == [0, 4, 8]
    with pytest.raises(ValueError):
        compute_checksum("md5")


def test_label_dtype() -> None:
    assert label_dtype_for(5) == np.uint8
    assert label_dtype_for(256) == np.uint8
    assert label_dtype_for(257) == np.dtype("<u2")


# ----------------------------------------------------------------------------- value statistics


def test_value_stats_match_numpy_and_skip_nonfinite() -> None:
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((n, 5, 5)).astype(np.float32) * 3 + 1 for n in (10, 1, 37)]
    parts[1][0, 0, 0] = np.nan
    parts[2][3, 1, 1] = np.inf
    stats = ValueStats()
    for p in parts:
        stats.update(p)
    stats.update(np.zeros((0, 5, 5), np.float32))
    flat = np.concatenate([p.reshape(-1) for p in parts]).astype(np.float64)
    finite = flat[np.isfinite(flat)]
    assert stats.nonfinite == 2
    assert stats.n == finite.size
    assert stats.mean == pytest.approx(finite.mean(), rel=1e-12)
    assert stats.std == pytest.approx(finite.std(), rel=1e-9)
    assert stats.min == finite.min() and stats.max == finite.max()
    assert ValueStats().mean is None and ValueStats().std is None


def _stats_by_fresh_float64_chunks(flat: np.ndarray) -> dict[str, object]:
    """ValueStats.update as written before its buffers were reused: each chunk through flat.astype(float64)."""
    s = ValueStats()
    for lo in range(0, flat.size, ValueStats.CHUNK):
        part = flat[lo : lo + ValueStats.CHUNK]
        if part.dtype.kind == "f":
            s.nonfinite += int(part.size - np.count_nonzero(np.isfinite(part)))
            part = part[np.isfinite(part)]
            if not part.size:
                continue
        f64 = part.astype(np.float64)
        lo_v, hi_v = float(f64.min()), float(f64.max())
        if max(abs(lo_v), abs(hi_v)) > 0:
            s._rescale(math.frexp(max(abs(lo_v), abs(hi_v)))[1] - 450)
        if s.scale:
            f64 = np.ldexp(f64, -s.scale)
        s.n, s.sum = s.n + f64.size, s.sum + float(f64.sum())
        s.sumsq += float(np.einsum("i,i->", f64, f64))
        s.min = lo_v if s.min is None else min(s.min, lo_v)
        s.max = hi_v if s.max is None else max(s.max, hi_v)
    return vars(s)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "uint8", "int64", "uint64"])
def test_value_stats_are_the_same_floats_as_fresh_float64_chunks(dtype: str) -> None:
    # the stores written before keep their statistics bit for bit: same chunks, same order of summation
    rng = np.random.default_rng(3)
    n = 2 * ValueStats.CHUNK + 12345
    if np.dtype(dtype).kind == "f":
        x = (rng.standard_normal(n) * 1e3).astype(dtype)
        x[::997] = np.nan
        x[5] = np.inf
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    for part in (x, x[1:], x[: ValueStats.CHUNK], x[:7]):
        stats = ValueStats()
        stats.update(part)
        assert vars(stats) == _stats_by_fresh_float64_chunks(part)


@pytest.mark.parametrize("sizes", [[5, ValueStats.CHUNK, 3], [ValueStats.CHUNK + 1] * 3, [0, 10, 0, 7], [100_000] * 9])
def test_value_stats_of_batches_are_those_of_their_concatenation(sizes: list[int]) -> None:
    # the writer folds a commit's batches in without concatenating them: the same floats
    rng = np.random.default_rng(4)
    batches = [(rng.standard_normal(n) * 100).astype(np.float32) for n in sizes]
    batches[-1][:3] = [np.nan, np.inf, -np.inf]
    whole, parts = ValueStats(), ValueStats()
    whole.update(np.concatenate(batches))
    parts.update_all(batches)
    assert vars(parts) == vars(whole)


def test_value_stats_of_huge_values_stay_finite() -> None:
    # squares of values above ~1e154 overflow float64: the moments are kept scaled by a power of two
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal(n) * 10.0**e for n, e in ((50, 0), (40, 200), (30, 307))]
    parts[2][0] = np.finfo(np.float64).max
    stats, merged = ValueStats(), ValueStats()
    for p in parts:
        stats.update(p)
        one = ValueStats()
        one.update(p)
        merged.merge(one)  # as write_parallel does with the workers' statistics
    flat = np.concatenate(parts)
    scaled = flat / 1e300  # numpy's own mean/std would overflow here
    for s in (stats, merged):
        assert s.n == flat.size and s.scale > 0
        assert s.mean == pytest.approx(scaled.mean() * 1e300, rel=1e-9)
        assert s.std == pytest.approx(scaled.std() * 1e300, rel=1e-9)
        assert s.min == flat.min() and s.max == flat.max()
        assert math.isfinite(s.sum) and math.isfinite(s.sumsq)
    meta = _meta().with_(value_stats=stats)
    back = StoreMeta.from_json(meta.to_json())  # the metadata is valid JSON and reads back
    assert back.value_stats == stats and back.value_stats.std == stats.std


# ----------------------------------------------------------------------------- metadata


def _meta() -> StoreMeta:
    stats = ValueStats()
    stats.update(np.arange(10, dtype=np.float32))
    return StoreMeta(
        shape=(25, 25),
        dtype="<f4",
        classes=["a", "b", "c"],
        samples_per_value=18,
        checksum="crc32",
        count=40,
        class_counts=[10, 20, 10],
        created_by="test",
        created_at="2024-01-01T00:00:00+00:00",
        updated_at="2024-01-02T00:00:00+00:00",
        value_stats=stats,
    )


def _raw(**changes: object) -> bytes:
    d = json.loads(_meta().to_json())
    for k, v in changes.items():
        if v is _DELETE:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d).encode()


class _Deleted:
    """The field is left out of the JSON (a fixed repr keeps test ids the same in every xdist worker)."""

    def __repr__(self) -> str:
        return "<deleted>"


_DELETE = _Deleted()


def test_meta_json_round_trip() -> None:
    meta = _meta()
    back = StoreMeta.from_json(meta.to_json())
    assert back == meta
    assert isinstance(back.shape, tuple)
    assert back.value_stats.mean == pytest.approx(4.5)
    assert StoreMeta.from_json(memoryview(meta.to_json())) == meta
    # the record is plain JSON (never pickle), with the format name and version
    d = json.loads(meta.to_json())
    assert d["format"] == "lmdbstore" and d["format_version"] == FORMAT_VERSION


def test_meta_derived_values() -> None:
    meta = _meta()
    assert meta.sample_bytes == 2500
    assert meta.value_bytes == 45000
    assert meta.trailer_bytes == 4
    assert meta.n_values == 3  # 18 + 18 + 4
    assert meta.expected_value_len(0) == 45004
    assert meta.expected_value_len(36) == 4 * 2500 + 4
    assert StoreMeta((3,), "|u1", ["x", "y"], 4).class_counts == [0, 0]


@pytest.mark.parametrize("raw", [b"not json", b"\xff\xfe", b"", b"[1, 2]", b"42", b'"meta"'])
def test_from_json_rejects_malformed(raw: bytes) -> None:
    with pytest.raises(CorruptStoreError) as exc:
        StoreMeta.from_json(raw, path="/some/store")
    assert not isinstance(exc.value, FormatVersionError)
    assert "\n" not in str(exc.value) and "/some/store" in str(exc.value)


def test_from_json_rejects_other_format() -> None:
    with pytest.raises(CorruptStoreError, match="format"):
        StoreMeta.from_json(_raw(format="hdf5"))
    with pytest.raises(CorruptStoreError, match="format"):
        StoreMeta.from_json(_raw(format=_DELETE))


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0, 99, "1", None, 2.0, 1.0, True, _DELETE])
def test_from_json_rejects_unknown_version(version: object) -> None:
    with pytest.raises(FormatVersionError) as exc:
        StoreMeta.from_json(_raw(format_version=version), path="p")
    assert "\n" not in str(exc.value)
    if type(version) is int and version > FORMAT_VERSION:
        assert exc.value.hint and "upgrade" in exc.value.hint


@pytest.mark.parametrize(
    "changes",
    [
        {"shape": []},
        {"shape": [0, 25]},
        {"shape": [25.0, 25]},
        {"shape": [True, 25]},
        {"shape": "25x25"},
        {"shape": [2, 2, 2, 2, 2]},
        {"shape": [1 << 17]},
        {"shape": _DELETE},
        {"dtype": "float32"},
        {"dtype": ">f4"},
        {"dtype": "|O"},
        {"dtype": 5},
        {"classes": []},
        {"classes": ["a", "a", "b"]},
        {"classes": ["a", 2, "c"]},
        {"classes": "abc"},
        {"count": -1},
        {"count": "40"},
        {"count": True},
        {"count": 41},
        {"count": 2**49},
        {"class_counts": [10, 20]},
        {"class_counts": [10, 20, 11]},
        {"class_counts": [-10, 40, 10]},
        {"class_counts": [10.0, 20, 10]},
        {"class_counts": _DELETE},
        {"samples_per_value": 0},
        {"samples_per_value": "18"},
        {"checksum": "md5"},
        {"label_chunk": 0},
        {"label_chunk": 1.5},
        {"value_stats": [1, 2]},
        {"value_stats": {"n": "many"}},
        {"value_stats": {"n": 3, "sum": "x"}},
        {"value_stats": {"n": -1}},
        {"value_stats": {"min": [1]}},
        {"value_stats": {"sum": None}},
        {"value_stats": {"n": 1, "bogus": 2, "sum": 1.0}},
    ],
    ids=lambda c: repr(c),
)
def test_from_json_rejects_bad_fields(changes: dict[str, object]) -> None:
    if changes == {"value_stats": {"n": 1, "bogus": 2, "sum": 1.0}}:
        # unknown statistics keys are ignored (forward compatible), the known ones kept
        meta = StoreMeta.from_json(_raw(**changes))
        assert meta.value_stats.n == 1 and meta.value_stats.sum == 1.0
        return
    with pytest.raises(CorruptStoreError) as exc:
        StoreMeta.from_json(_raw(**changes), path="/s")
    assert not isinstance(exc.value, FormatVersionError)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"sum": 45.0', '"sum": NaN'),
        ('"sumsq": 285.0', '"sumsq": Infinity'),
        ('"min": 0.0', '"min": -Infinity'),
        ('"sum": 45.0', '"sum": ' + "9" * 400),
        ('"sumsq": 285.0', '"sumsq": -1.0'),
        ('"n": 10', '"n": ' + "9" * 400),
        ('"scale": 0', '"scale": 5000'),
        ('"scale": 0', '"scale": 1100'),
        ('"count": 40', '"count": NaN'),
    ],
    ids=lambda v: v[:30],
)
def test_from_json_refuses_nonfinite_and_out_of_range_statistics(old: str, new: str) -> None:
    raw = _meta().to_json().decode()
    assert old in raw
    with pytest.raises(CorruptStoreError) as exc:
        StoreMeta.from_json(raw.replace(old, new).encode(), path="/s")
    assert "\n" not in str(exc.value) and str(exc.value).startswith("/s:")


def test_metadata_written_before_the_scale_field_still_opens() -> None:
    d = json.loads(_meta().to_json())
    del d["value_stats"]["scale"]
    meta = StoreMeta.from_json(json.dumps(d).encode())
    assert meta.value_stats.scale == 0 and meta.value_stats.mean == pytest.approx(4.5)
