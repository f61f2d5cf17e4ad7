"""CLI commands on damaged stores: seeded single-byte damage anywhere in ``data.mdb`` (meta pages, every
B-tree, overflow data); for each flip ``stats``, ``stats --sample``, ``verify``, ``export`` and ``copy`` run
in a worker process.  Each must end with a documented exit status and at most one ``error:`` line on stderr:
no traceback, no death by a signal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from conftest import REPO, build_store, make_data

from lmdbstore import WriterConfig

FLIPS = 100
SEED = 18
WORKER = Path(__file__).with_name("cli_flip_worker.py")
#: Exit statuses each command may end with (docs/cli.md): verify 2 when the store cannot be opened at all.
ALLOWED = {"stats": {0, 1}, "verify": {0, 1, 2}, "export": {0, 1}, "copy": {0, 1}}


def _plan(size: int, psize: int, rng: np.random.Generator) -> np.ndarray:
    """Flips anywhere, with a third of them in the first pages (meta pages and the small B-trees)."""
    rows = []
    for _ in range(FLIPS):
        hi = 8 * psize if rng.random() < 1 / 3 else size
        xor = 1 << int(rng.integers(8)) if rng.random() < 0.5 else int(rng.integers(1, 256))
        rows.append((int(rng.integers(0, hi)), xor))
    return np.asarray(rows, np.int64)


def test_cli_on_damaged_stores(tmp_path: Path) -> None:
    x, y = make_data(3000, seed=5)
    store = build_store(tmp_path / "s", x, y, config=WriterConfig(sync=False), batch=1000)
    plan_file, out = tmp_path / "plan.npy", tmp_path / "out"
    out.mkdir()
    np.save(plan_file, _plan(os.path.getsize(store / "data.mdb"), 4096, np.random.default_rng(SEED)))
    pristine = tmp_path / "pristine.mdb"
    shutil.copyfile(store / "data.mdb", pristine)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    records, deaths, start = [], [], 0
    while start < FLIPS:
        p = subprocess.run(
            [sys.executable, str(WORKER), str(store), str(plan_file), str(start), str(out)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        lines = [json.loads(ln) for ln in p.stdout.splitlines()]
        records += [r for r in lines if "code" in r]
        if p.returncode == 0:
            break
        last = lines[-1] if lines else {"i": start, "cmd": "?"}
        deaths.append((last["i"], last["cmd"], p.returncode, p.stderr[-300:]))
        shutil.copyfile(pristine, store / "data.mdb")
        start = last["i"] + 1
    codes = Counter((r["cmd"].split()[0], r["code"]) for r in records)
    print(dict(codes))
    assert not deaths, f"a CLI command died: {deaths[:5]}"
    assert len(records) == FLIPS * 5
    bad = [r for r in records if r["traceback"] or not r["one"] or r["code"] not in ALLOWED[r["cmd"].split()[0]]]
    assert not bad, bad[:5]
    assert codes[("verify", 1)] > 0 and codes[("stats", 0)] > 0  # the damage was found, and some was harmless
