"""``verify`` on the file it opened (``lmdbstore.tools.verify_structure``): a store replaced while it is verified --
``rm -r A && cp -r B A``, or ``cp B/data.mdb A/data.mdb`` in place, caught half-way as a copy in progress leaves it --
is a one-line "replaced" error (the CLI's exit 2), never a report on another file (issue 39 #5: 9 ``structure``
problems, exit 1, though both stores are healthy).  Real stores, real worker processes; the replacement is made
from verify's own ``total`` callback, which comes once the page walk and the value pass have begun."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import build_store, make_data

from lmdbstore import StoreReader, WriterConfig
from lmdbstore.errors import StoreReplacedError
from lmdbstore.tools.verify import verify_store
from lmdbstore.tools.verify_structure import AtRest

N = 8_003  # 10 MB in 2,001 values of 4 float16 25x25 samples


def _store(path: Path, seed: int) -> Path:
    x, y = make_data(N, seed, dtype=np.float16)
    return build_store(path, x, y, config=WriterConfig(samples_per_value=4), batch=3_000)


def _half_copied(src: Path, dst: Path) -> None:
    """``dst`` as ``cp src dst`` leaves it half-way: the first half of the file written."""
    data = src.read_bytes()
    with open(dst, "r+b" if dst.exists() else "wb") as f:
        f.truncate(0)
        f.write(data[: len(data) // 2])


def _rm_cp(a: Path, b: Path) -> None:
    shutil.rmtree(a)
    a.mkdir()
    for f in b.iterdir():
        if f.name != "data.mdb":
            shutil.copy(f, a / f.name)
    _half_copied(b / "data.mdb", a / "data.mdb")


def _in_place(a: Path, b: Path) -> None:
    _half_copied(b / "data.mdb", a / "data.mdb")


@pytest.mark.parametrize("replace", [_rm_cp, _in_place], ids=["rm-r-and-cp-r", "cp-in-place"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_store_replaced_while_verified_is_one_line_replaced(
    tmp_path: Path, replace: Callable[[Path, Path], None], workers: int
) -> None:
    a, b = _store(tmp_path / "a", 0), _store(tmp_path / "b", 1)
    assert verify_store(a).ok and verify_store(b).ok  # both healthy

    def meanwhile(_count: int) -> None:  # the walk and the value pass have begun
        replace(a, b)

    with pytest.raises(StoreReplacedError, match="the data file was replaced while it was verified") as err:
        verify_store(a, workers=workers, total=meanwhile)
    assert "run verify again" in str(err.value) and "\n" not in str(err.value)
    shutil.rmtree(a)
    shutil.copytree(b, a)  # the copy done: verify again
    assert verify_store(a, workers=workers).ok


def test_the_checks_see_the_file_opened_and_liblmdb_must_show_it(tmp_path: Path) -> None:
    """What ``AtRest`` holds is the file as opened: a path that names another file since, or liblmdb opened on
    another file, is "replaced"; the same file, untouched, is not."""
    a, b = _store(tmp_path / "a", 0), _store(tmp_path / "b", 1)
    rest = AtRest(a)
    try:
        assert rest.meta is not None and rest.snap is not None and rest.meta.count == N
        rest.check_unchanged()
        with StoreReader(a) as r:
            rest.check_same(r)  # the same file and snapshot
        os.rename(a / "data.mdb", tmp_path / "old.mdb")
        shutil.copy(b / "data.mdb", a / "data.mdb")
        with pytest.raises(StoreReplacedError):
            rest.check_unchanged()
        with StoreReader(a) as r, pytest.raises(StoreReplacedError):
            rest.check_same(r)
    finally:
        rest.close()
