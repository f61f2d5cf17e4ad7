"""What the B-tree reading (lmdbstore.format.btree) and the position table (lmdbstore.store.positions) refuse:
each damage below used to make the offset path return another value's bytes, or would; now each is a
one-line CorruptStoreError naming ``lmdbstore verify``, while undamaged values still read."""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import build_store, make_data

from lmdbstore import WriterConfig
from lmdbstore.errors import CorruptStoreError
from lmdbstore.format.btree import main_db_entry
from lmdbstore.format.layout import DB_SAMPLES, encode_key
from lmdbstore.format.pages import P_BRANCH, P_LEAF, PageReader, read_meta_page
from lmdbstore.store import positions
from lmdbstore.store.reader import StoreReader

CFG = WriterConfig(sync=False)


@dataclass(frozen=True)
class Node:
    """A leaf node of the samples B-tree: its file offset, key and overflow page (0: inline)."""

    at: int
    key: int
    ov: int


def _tree(path: Path) -> tuple[list[Node], list[tuple[int, list[int]]], int]:
    """Leaf nodes in key order, branch pages (file offset of each node), page size."""
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        meta = max((read_meta_page(fd, size, i) for i in (0, 1)), key=lambda m: m.txnid)
        pages, ps = PageReader(fd, size, meta, path, None), meta.psize
        db = main_db_entry(pages, meta.main, DB_SAMPLES)
        level, branches = [db.root], []
        for _ in range(db.depth - 1):
            nxt = []
            for pgno, page in zip(level, pages.read(level, P_BRANCH), strict=True):
                ptr, words = pages.nodes(page, pgno)
                branches.append((pgno, [pgno * ps + o for o in ptr.tolist()]))
                nxt += [int(words[o // 2]) | int(words[o // 2 + 1]) << 16 | int(words[o // 2 + 2]) << 32 for o in ptr]
            level = nxt
        nodes = []
        for pgno, page in zip(level, pages.read(level, P_LEAF), strict=True):
            ptr, words = pages.nodes(page, pgno)
            for o in ptr.tolist():
                key = int.from_bytes(page[o + 8 : o + 16].tobytes(), "big")
                big = int(words[o // 2 + 2]) & 1
                ov = int.from_bytes(page[o + 16 : o + 24].tobytes(), "little") if big else 0
                nodes.append(Node(pgno * ps + o, key, ov))
        return nodes, branches, ps
    finally:
        os.close(fd)


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path / "data.mdb", "r+b") as f:
        f.seek(offset)
        f.write(data)


def _refused(path: Path, indices: list[int], match: str) -> None:
    with StoreReader(path) as r, pytest.raises(CorruptStoreError, match=match) as exc:
        r.read_batch(indices)
    assert "\n" not in str(exc.value) and "lmdbstore verify" in str(exc.value)


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, np.ndarray]:
    x, y = make_data(2000, seed=21)  # 112 values of 18 samples, each in 11 overflow pages; one leaf
    return build_store(tmp_path / "s", x, y, config=CFG), x


def test_a_duplicated_key_is_refused(store: tuple[Path, np.ndarray]) -> None:
    """The reported case: a flipped key bit made value 0's key equal value 2's; the table kept the later
    node, so samples 0..17 came back as 36..53."""
    path, _ = store
    nodes, _, _ = _tree(path)
    _poke(path, nodes[0].at + 8, encode_key(nodes[2].key))
    _refused(path, list(range(18)), "out of order|where 0 belongs")


def test_a_key_out_of_the_sequence_is_refused(store: tuple[Path, np.ndarray]) -> None:
    path, _ = store
    nodes, _, _ = _tree(path)
    _poke(path, nodes[5].at + 8, encode_key(nodes[5].key + 1))  # still in order, not a multiple of k
    _refused(path, [0], "where 90 belongs")


def test_an_overflow_page_number_of_another_value_is_refused(store: tuple[Path, np.ndarray]) -> None:
    path, _ = store
    nodes, _, _ = _tree(path)
    _poke(path, nodes[3].at + 16, struct.pack("<Q", nodes[7].ov))
    _refused(path, [0], "share overflow pages")


def test_an_overflow_page_number_into_another_run_is_refused(store: tuple[Path, np.ndarray]) -> None:
    path, _ = store
    nodes, _, _ = _tree(path)
    _poke(path, nodes[3].at + 16, struct.pack("<Q", nodes[7].ov + 4))
    _refused(path, [0], "share overflow pages")


@pytest.fixture
def leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, np.ndarray]:
    """One 2,500-byte sample per value (one overflow page each): 13 leaves; a batch reads only the leaves it needs
    (no extra ones), so the tree stays partly read and overflow headers are checked as values are first read."""
    monkeypatch.setattr(positions, "EXTRA_LEAVES", 0)
    x, y = make_data(2000, seed=23)
    return build_store(tmp_path / "l", x, y, config=WriterConfig(sync=False, samples_per_value=1)), x


@pytest.mark.parametrize(("field", "value"), [(10, b"\x02\x00"), (0, b"\x07"), (12, struct.pack("<I", 0))])
def test_a_damaged_overflow_header_is_refused_on_first_read(
    leaves: tuple[Path, np.ndarray], field: int, value: bytes
) -> None:
    """flags (a leaf page, not an overflow page), its own page number, its page count (too short)."""
    path, x = leaves
    nodes, _, ps = _tree(path)
    _poke(path, nodes[4].ov * ps + field, value)
    with StoreReader(path) as r:
        np.testing.assert_array_equal(r.read_batch([0, 1999]), x[[0, 1999]])  # the other values read
        with pytest.raises(CorruptStoreError, match="overflow page") as exc:
            r.read_batch([4, 5])
        assert exc.value.key == 4
        assert r.read_path == "positions"


def test_overflow_headers_are_checked_once_per_value_until_every_leaf_is_read(leaves: tuple[Path, np.ndarray]) -> None:
    path, x = leaves
    with StoreReader(path) as r:
        np.testing.assert_array_equal(r.read_batch([40, 41]), x[[40, 41]])
        table = r._table
        assert table is not None and not table.complete
        assert set(np.flatnonzero(table.checked).tolist()) == {40, 41}
        r.read_batch(np.arange(2000))
        assert table.complete and table.checked.all()  # every page claimed once: every run is its value's own


def test_a_missing_last_value_contradicts_the_count(store: tuple[Path, np.ndarray]) -> None:
    from conftest import raw_env

    path, _ = store
    with raw_env(path) as env, env.begin(write=True) as txn:
        txn.delete(encode_key(1998), db=env.open_db(DB_SAMPLES, txn=txn, create=False))
    _refused(path, [0], "holds 111 values; a count of 2000 means 112")


@pytest.fixture
def deep(tmp_path: Path) -> tuple[Path, np.ndarray]:
    x, y = make_data(2100, seed=22, shape=(99,))  # 396-byte samples, one per value, in leaf pages: depth 3
    path = build_store(tmp_path / "d", x, y, config=WriterConfig(sync=False, samples_per_value=1))
    with StoreReader(path) as r:
        assert r.env_stats()["dbs"]["samples"]["depth"] == 3
    return path, x


def test_a_separator_that_does_not_separate_is_refused(deep: tuple[Path, np.ndarray]) -> None:
    """liblmdb descends by the separators: one that lies above its subtree's first key would send a lookup
    to another leaf than the walk found, so the walk refuses it."""
    path, _ = deep
    _, branches, _ = _tree(path)
    _, nodes = branches[-1]
    _poke(path, nodes[1] + 8, encode_key(10**9))
    _refused(path, [0], "separator")


def test_a_page_reached_twice_is_refused(deep: tuple[Path, np.ndarray]) -> None:
    path, _ = deep
    _, branches, _ = _tree(path)
    _, nodes = branches[-1]
    with open(path / "data.mdb", "rb") as f:
        f.seek(nodes[0])
        first_child = f.read(6)
    _poke(path, nodes[1], first_child)
    _refused(path, [0], "twice|out of order")


# --------------------------------------------------------------- pages another sub-database owns (issue 34 #1)


def _runs_of(path: Path, name: bytes, free: bool = False) -> list[tuple[int, int]]:
    """``(first page, pages)`` of the overflow runs of sub-database ``name``'s values, or with ``free`` the runs of
    free pages the free list lists (consecutive page numbers)."""
    from lmdbstore.format.owners import walk_tree

    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        meta = max((read_meta_page(fd, size, i) for i in (0, 1)), key=lambda m: m.txnid)
        pages = PageReader(fd, size, meta, path, None)
        if free:
            _, leaves = walk_tree(pages, meta.free, "free", values=True)
            raw = [pages.read_bytes(off, n, "a free-list value") for _, off, n in leaves.values]
            ids = sorted(int(p) for r in raw for p in np.frombuffer(r, "<u8")[1:])
            runs: list[tuple[int, int]] = []
            for p in ids:
                if runs and runs[-1][0] + runs[-1][1] == p:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                else:
                    runs.append((p, 1))
            return runs
        _, main = walk_tree(pages, meta.main, "main")
        _, leaves = walk_tree(pages, main.subdbs[name], name.decode())
        return list(zip(leaves.runs.start.tolist(), leaves.runs.count.tolist(), strict=True))
    finally:
        os.close(fd)


@pytest.fixture
def classidx_store(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """2 samples a value (2 overflow pages each) and 2 classes (~1,500 class-index entries each: 3-page runs with a
    valid overflow header), committed in 6 batches (the class-index chunks rewritten: old runs on the free list)."""
    x, y = make_data(3000, seed=4, n_classes=2)
    path = build_store(
        tmp_path / "s", x, y, classes=["a", "b"], config=WriterConfig(samples_per_value=2, sync=False), batch=500
    )
    return path, x


def _reads_refused(path: Path, x: np.ndarray, monkeypatch: pytest.MonkeyPatch, match: str) -> None:
    """Every read path lmdbstore has raises one line naming ``lmdbstore verify`` (labels and a class index read first
    through liblmdb may pass; the first batch refuses): never the other owner's bytes."""
    from lmdbstore.store import fileread

    ways = {
        "offset, compiled reader": ({}, fileread.COMPILED),
        "offset, preadv": ({}, None),
        "liblmdb": ({"positions": False}, fileread.COMPILED),
        "liblmdb, checksums": ({"verify_checksums": True}, fileread.COMPILED),
    }
    for what, (kw, c) in ways.items():
        monkeypatch.setattr(fileread, "COMPILED", c)
        for first in (None, "labels", "class_indices"):  # what a loader reads before its first batch, too
            with StoreReader(path, **kw) as r, pytest.raises(CorruptStoreError) as exc:  # type: ignore[arg-type]
                if first is not None:  # read through liblmdb before the walk: it may pass or refuse
                    r.labels() if first == "labels" else r.class_indices(1)
                r.read_batch([0, 1, 2999])  # never another owner's bytes as samples
            assert "\n" not in str(exc.value) and "lmdbstore verify" in str(exc.value), what
            assert first is not None or re.search(match, str(exc.value)), str(exc.value)


@pytest.mark.parametrize("owner", ["classidx", "free"])
def test_an_overflow_page_number_of_another_owner_is_refused_on_every_read_path(
    classidx_store: tuple[Path, np.ndarray], owner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Value 0's overflow page number flipped to the first page of a run another sub-database owns (a class-index
    chunk: a valid overflow header and enough pages), or of a free run that held an older class-index chunk: the
    value's own checks all pass and liblmdb follows it, so plain reads returned that owner's bytes as samples,
    exit 0.  The page is reachable twice: every read path refuses the snapshot."""
    path, x = classidx_store
    nodes, _, ps = _tree(path)
    need = 2  # a samples value's pages
    if owner == "free":
        runs = [r for r in _runs_of(path, b"", free=True) if r[1] >= need]
    else:
        runs = [r for r in _runs_of(path, owner.encode()) if r[1] >= need]
    assert runs, f"the fixture has no {owner} run of {need} pages"
    start = runs[0][0]
    if owner != "free":  # a valid overflow header there: what made the value's own checks pass
        with open(path / "data.mdb", "rb") as f:
            f.seek(start * ps)
            head = f.read(16)
        assert int.from_bytes(head[:8], "little") == start and head[10] & 0x04
    _poke(path, nodes[0].at + 16, struct.pack("<Q", start))
    _reads_refused(path, x, monkeypatch, "reachable twice")


def test_a_page_of_the_samples_tree_reachable_from_another_owner_is_refused(
    classidx_store: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other way round: a class-index chunk's overflow page number flipped onto a samples value's run (the
    class index read through liblmdb would return samples as indices)."""
    path, x = classidx_store
    nodes, _, _ = _tree(path)
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        from lmdbstore.format.owners import walk_tree

        size = os.fstat(fd).st_size
        meta = max((read_meta_page(fd, size, i) for i in (0, 1)), key=lambda m: m.txnid)
        pages = PageReader(fd, size, meta, path, None)
        _, main = walk_tree(pages, meta.main, "main")
        db = main.subdbs[b"classidx"]
        assert db.depth == 1
        leaf = pages.read([db.root], P_LEAF)[0]
        ptr, words = pages.nodes(leaf, db.root)
        o = int(ptr[0])
        ksize = int(words[o // 2 + 3])
        at = db.root * meta.psize + o + 8 + ksize  # the first chunk's overflow page number
    finally:
        os.close(fd)
    _poke(path, at, struct.pack("<Q", nodes[5].ov))
    _reads_refused(path, x, monkeypatch, "reachable twice")
