"""Differential fuzz of the offset read path against liblmdb: seeded single-byte damage to the ``samples``
B-tree of small stores at depth 2 (values in overflow pages) and depth 3 (values inside leaf pages).

For each flip every sample is read through the default reader (position table and ``preadv``) and every
value through plain liblmdb lookups, in a worker process (liblmdb may crash on a damaged page; the offset
path must not).  The offset path must raise :class:`~lmdbstore.errors.LmdbStoreError` or return exactly the
samples written: never other bytes in silence, whatever liblmdb does with the same flip.  The targets are
the bytes liblmdb and the parser rely on: leaf keys, leaf node headers, overflow page numbers, overflow page
headers, leaf page headers and pointer arrays, and whole branch pages.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, build_store, make_data

from lmdbstore import WriterConfig
from lmdbstore.format.btree import main_db_entry
from lmdbstore.format.layout import DB_SAMPLES
from lmdbstore.format.pages import P_BRANCH, P_LEAF, PageReader, read_meta_page
from lmdbstore.store.reader import StoreReader

#: Flips per store (two stores: at least 2,000 per run), and the seed of the plan.
FLIPS = 1100
SEED = 20240518
WORKER = Path(__file__).with_name("flip_worker.py")
CATEGORIES = ("leaf-key", "leaf-node", "ov-pgno", "ov-header", "leaf-page", "branch")


def _targets(path: Path) -> dict[str, np.ndarray]:
    """File offsets of the bytes of each category, from the pristine store."""
    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        meta = max((read_meta_page(fd, size, i) for i in (0, 1)), key=lambda m: m.txnid)
        pages = PageReader(fd, size, meta, path, None)
        ps = meta.psize
        db = main_db_entry(pages, meta.main, DB_SAMPLES)
        out: dict[str, list[int]] = {c: [] for c in CATEGORIES}
        level = [db.root]
        for _ in range(db.depth - 1):  # branch levels: every used byte of every page
            nxt = []
            for pgno, page in zip(level, pages.read(level, P_BRANCH), strict=True):
                ptr, words = pages.nodes(page, pgno)
                lower, upper = int(words[6]), int(words[7])
                base = pgno * ps
                out["branch"] += list(range(base, base + lower)) + list(range(base + upper, base + ps))
                for o in ptr.tolist():
                    w = o // 2
                    nxt.append(int(words[w]) | int(words[w + 1]) << 16 | int(words[w + 2]) << 32)
            level = nxt
        for pgno, page in zip(level, pages.read(level, P_LEAF), strict=True):
            ptr, words = pages.nodes(page, pgno)
            base = pgno * ps
            out["leaf-page"] += list(range(base, base + int(words[6])))
            for o in ptr.tolist():
                node = base + o
                out["leaf-node"] += list(range(node, node + 8))
                out["leaf-key"] += list(range(node + 8, node + 16))
                if int(words[o // 2 + 2]) & 1:  # F_BIGDATA
                    out["ov-pgno"] += list(range(node + 16, node + 24))
                    ov = int.from_bytes(page[o + 16 : o + 24].tobytes(), "little")
                    out["ov-header"] += list(range(ov * ps, ov * ps + 16))
        return {c: np.asarray(v, np.int64) for c, v in out.items() if v}
    finally:
        os.close(fd)


def _plan(targets: dict[str, np.ndarray], n: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """``n`` seeded flips: a category, a byte of it, and one flipped bit or a random other byte."""
    rng = np.random.default_rng(seed)
    cats = sorted(targets)
    rows, kinds = [], []
    for _ in range(n):
        c = cats[int(rng.integers(len(cats)))]
        off = int(targets[c][int(rng.integers(len(targets[c])))])
        xor = 1 << int(rng.integers(8)) if rng.random() < 0.5 else int(rng.integers(1, 256))
        rows.append((off, xor))
        kinds.append(c)
    return np.asarray(rows, np.int64), kinds


def _run(path: Path, plan_file: Path) -> tuple[dict[int, dict[str, str]], list[int]]:
    """Run the worker over every flip (it restarts its forked child after a crash, restoring the pristine file):
    each flip's records, and the flips after which liblmdb crashed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, str(WORKER), str(path), str(plan_file)], capture_output=True, text=True, timeout=300, env=env
    )
    assert p.returncode == 0, p.stderr[-2000:]  # only a signal (liblmdb's crash) may end a flip early
    results: dict[int, dict[str, str]] = {}
    crashed: list[int] = []
    for line in p.stdout.splitlines():
        rec = json.loads(line)
        if "crash" in rec:
            crashed.append(rec["i"])
        else:
            results.setdefault(rec["i"], {}).update({k: v for k, v in rec.items() if k != "i"})
    return results, crashed


STORES = {
    # 3,000 25x25 float32 samples, 18 per value: 167 values of 11 overflow pages, a B-tree of depth 2
    "overflow-depth2": dict(n=3000, shape=(25, 25), config=WriterConfig(sync=False), depth=2),
    # 2,100 samples of 396 bytes, one per value: values inside leaf pages, 9 to a leaf, depth 3
    "inline-depth3": dict(n=2100, shape=(99,), config=WriterConfig(sync=False, samples_per_value=1), depth=3),
}


@pytest.mark.parametrize("name", sorted(STORES))
def test_damaged_btree_reads_right_or_fails_never_wrong(tmp_path: Path, name: str) -> None:
    spec = STORES[name]
    x, y = make_data(spec["n"], seed=7, shape=spec["shape"])  # type: ignore[arg-type]
    path = build_store(tmp_path / "s", x, y, config=spec["config"])  # type: ignore[arg-type]
    with StoreReader(path) as r:
        assert r.env_stats()["dbs"]["samples"]["depth"] == spec["depth"]
    truth = hashlib.sha1(x.tobytes()).hexdigest()
    targets = _targets(path)
    assert set(targets) >= set(CATEGORIES) - ({"ov-pgno", "ov-header"} if name.startswith("inline") else set())
    plan, kinds = _plan(targets, FLIPS, SEED + len(name))
    plan_file = tmp_path / "plan.npy"
    np.save(plan_file, plan)
    results, crashed = _run(path, plan_file)
    wrong, both_wrong, outcome = [], [], Counter()
    for i in range(FLIPS):
        rec = results.get(i, {})
        assert "fast" in rec, f"flip {i} ({kinds[i]}): the offset path did not finish (crashed?)"
        fast, lm = rec["fast"], rec.get("lmdb", "crash")
        if fast == "error":
            outcome["fast error"] += 1
            assert "\n" not in rec["why"]
        elif fast == truth:
            outcome["fast right"] += 1
        elif fast == lm:
            both_wrong.append((i, kinds[i]))
        else:
            wrong.append((i, kinds[i], int(plan[i, 0]), int(plan[i, 1])))
        outcome[f"lmdb {'right' if lm == truth else lm if lm in ('error', 'crash') else 'wrong'}"] += 1
    print(name, dict(outcome), "liblmdb crashed after flips", crashed)
    assert not wrong, f"offset path returned other bytes in silence: {wrong[:10]}"
    assert not both_wrong, f"offset path and liblmdb both returned other bytes: {both_wrong[:10]}"
    assert outcome["fast right"] > 0 and outcome["fast error"] > 0  # the flips reached both outcomes
