"""The contract every source kind keeps (sources/base.py, sources/checks.py): independent batches, argument
checks, fingerprints that change with the content, errors in the one hierarchy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SOURCE_N as N
from conftest import make_x, same_bits, write_dir

from lmdbstore.errors import LmdbStoreError, SourceError, ValidationError
from lmdbstore.ingestion.sources import open_source


def test_batches_are_independent_arrays(tmp_path: Path) -> None:
    """A caller (the writer) may keep every yielded batch: none is reused."""
    x = make_x()
    np.save(tmp_path / "a.npy", x)
    (src,) = open_source(tmp_path / "a.npy", label="a")
    kept = [b for b, _ in src.iter_batches(10)]
    assert same_bits(np.concatenate(kept), x)


def test_bad_batch_and_start_arguments(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", make_x())
    (src,) = open_source(tmp_path / "a.npy", label="a")
    with pytest.raises(ValueError, match="batch"):
        next(src.iter_batches(0))
    with pytest.raises(ValueError, match="start"):
        next(src.iter_batches(4, N + 1))
    with pytest.raises(ValueError, match="label"):
        open_source(tmp_path / "a.npy", label=True)
    with pytest.raises(ValueError, match="label"):
        open_source(tmp_path / "a.npy", label=-1)


def test_fingerprints(tmp_path: Path) -> None:
    x = make_x()
    npy, npz, root = tmp_path / "a.npy", tmp_path / "b.npz", tmp_path / "root"
    np.save(npy, x)
    np.savez(npz, x=x, y=np.arange(N) % 2, z=x)
    write_dir(root, make_x(90))

    def fp(path: Path, **kw: Any) -> list[str]:
        return [s.fingerprint() for s in open_source(path, **kw)]

    a = fp(npy, label="a")
    assert a == fp(npy, label="a")  # stable across opens
    assert a != fp(npy, label="b") and a != fp(npy, label=0)
    assert fp(npz) != fp(npz, x_key="z") and fp(npz) != fp(npz, label="a")
    fps = {*a, *fp(npz), *fp(root)}
    assert len(fps) == 4 and all(len(f.encode()) < 300 for f in fps)

    # same size, new content and mtime -> new fingerprint
    np.save(npy, x + 1)
    st = npy.stat()
    os.utime(npy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fp(npy, label="a") != a
    # only touching the file also counts as a change (mtime_ns)
    b = fp(npy, label="a")
    os.utime(npy, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert fp(npy, label="a") != b

    # a file added to one class changes that class's fingerprint only
    cat, dog = fp(root)
    np.save(root / "b_dog" / "s9.npy", make_x(2))
    cat2, dog2 = fp(root)
    assert cat2 == cat and dog2 != dog


def test_errors_are_lmdbstore_errors() -> None:
    assert issubclass(SourceError, LmdbStoreError) and issubclass(ValidationError, LmdbStoreError)
