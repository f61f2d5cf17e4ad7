"""The error hierarchy: one-line messages carrying path, key and hint; LMDB errors translated."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from lmdbstore.errors import (
    ChecksumError,
    CorruptStoreError,
    FormatVersionError,
    LmdbStoreError,
    StoreFullError,
    clip,
    preview,
    translate_lmdb_errors,
)


def test_message_is_one_line_with_path_key_and_hint() -> None:
    err = LmdbStoreError("value\nmissing  here", path="/s", key=18, hint="run verify")
    assert str(err) == "/s: value missing here (at 18) -- hint: run verify"
    assert (err.path, err.key, err.hint) == ("/s", 18, "run verify")
    assert issubclass(ChecksumError, CorruptStoreError) and issubclass(FormatVersionError, CorruptStoreError)


def test_lmdb_errors_are_translated(tmp_path: Path) -> None:
    with pytest.raises(StoreFullError, match="map is full"), translate_lmdb_errors(tmp_path, "commit"):
        raise lmdb.MapFullError("full")
    with pytest.raises(CorruptStoreError, match="corruption"), translate_lmdb_errors(tmp_path, "read"):
        raise lmdb.CorruptedError("bad page")
    with pytest.raises(LmdbStoreError, match="LMDB error") as info, translate_lmdb_errors(tmp_path, "read"):
        raise lmdb.BadTxnError("x")
    assert isinstance(info.value.__cause__, lmdb.BadTxnError)
    # a real map-full from a tiny environment, not just a constructed exception
    env = lmdb.open(str(tmp_path / "tiny"), map_size=64 << 10)
    try:
        with pytest.raises(StoreFullError), translate_lmdb_errors(tmp_path / "tiny", "put"), env.begin(write=True) as t:
            for i in range(1000):
                t.put(i.to_bytes(8, "big"), b"x" * 4000)
    finally:
        env.close()


def test_preview_and_clip_bound_what_a_message_shows() -> None:
    assert preview(range(100)) == "0, 1, 2, 3, 4, ... (95 more)"
    assert preview(["a", "b"], quote=True) == "'a', 'b'"
    assert preview(iter(range(10)), total=10, limit=2) == "0, 1, ... (8 more)"
    assert preview([]) == ""
    assert len(preview(["x" * 10_000] * 1000)) < 300
    assert clip("a\n  b") == "a b" and clip("y" * 100, 10) == "yyyyyyy..."
    err = LmdbStoreError("z" * 1_000_000, path="/p", hint="h")
    assert len(str(err)) < 500 and str(err).startswith("/p: zzz") and str(err).endswith("-- hint: h")
