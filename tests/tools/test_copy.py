"""``lmdbstore copy`` / :func:`copy_store` of a store this process cannot lock (issue 34 #9): a shared dataset in
a directory the user cannot write is copied lock-free, consistent, leaving the source as it was; beside a writer
it is refused in one line with a hint.  The CLI runs in a process that cannot bypass file permissions
(``without_dac.py``: root with its file capabilities dropped, or any other user)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, StoreInfo, dir_bytes

from lmdbstore import open_reader, open_writer
from lmdbstore.tools.verify import verify_store

SCRIPT = Path(__file__).resolve().parent / "without_dac.py"


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    if res.returncode == 77:
        pytest.skip("cannot drop the file capabilities here")
    return res


@pytest.fixture
def shared_store(small_store: StoreInfo) -> Iterator[StoreInfo]:
    """``small_store`` as another user's dataset: the directory 0555, its files 0444 (no ``lock.mdb`` to write)."""
    path = small_store.path
    with open_reader(path, lock=True) as r:  # a lock.mdb as a writer's last run leaves it
        assert len(r) == 2000
    files = sorted(path.iterdir())
    for p in files:
        p.chmod(0o444)
    path.chmod(0o555)
    try:
        yield small_store
    finally:
        path.chmod(0o755)
        for p in files:
            p.chmod(0o644)


def test_a_store_the_user_cannot_lock_is_copied_lock_free(shared_store: StoreInfo, tmp_path: Path) -> None:
    src, dest = shared_store.path, tmp_path / "mine"
    before = dir_bytes(src)
    res = _cli("copy", src, dest)
    assert res.returncode == 0, res.stderr  # was: "open: LMDB error: ...: Permission denied", exit 1
    assert "copied 2,000 samples" in res.stdout
    assert dir_bytes(src) == before  # the source as it was: nothing written, no lock file made
    assert verify_store(dest).ok
    with open_reader(dest) as r:
        np.testing.assert_array_equal(r.read_range(0, 2000), shared_store.x)
        np.testing.assert_array_equal(r.labels(), shared_store.y)
    res = _cli("copy", src, tmp_path / "compact", "--compact")
    assert res.returncode == 0, res.stderr
    assert verify_store(tmp_path / "compact").ok


def test_a_store_the_user_cannot_lock_is_refused_beside_a_writer(shared_store: StoreInfo, tmp_path: Path) -> None:
    with open_writer(shared_store.path):  # its owner appending (this test process may write it)
        res = _cli("copy", shared_store.path, tmp_path / "mine")
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "a writer is appending" in res.stderr and "hint: copy once the writer is done" in res.stderr
    assert not (tmp_path / "mine").exists() and not list(tmp_path.glob(".mine.copy-*"))
