"""Property tests (Hypothesis): any batch of samples of any allowed dtype and shape, with integer or named
labels, ingested from an ``.npz`` under any packing and checksum, reads back bit for bit through the offset
path and through liblmdb, in any order, with its labels and class index, and verifies clean."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lmdbstore import WriterConfig
from lmdbstore.format.dtypes import ALLOWED_DTYPES
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.sources import open_sources
from lmdbstore.store.reader import StoreReader
from lmdbstore.tools.verify import verify_store

#: Examples per run (each ingests a store and reads it back both ways, ~20 ms).
EXAMPLES = 150


@st.composite
def batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    """Samples of a random allowed dtype and shape, labels as ids or names, the file's class names."""
    dtype = np.dtype(draw(st.sampled_from(sorted(ALLOWED_DTYPES))))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = draw(st.integers(1, 90))
    if dtype.kind == "f":
        elements = st.floats(width=8 * dtype.itemsize, allow_nan=False, allow_infinity=False)
    else:
        elements = st.integers(int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
    x = draw(arrays(dtype, (n, *shape), elements=elements))
    k = draw(st.integers(1, 4))
    y = np.asarray(draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n)))
    names = draw(st.none() | st.just([f"class {i}" for i in range(k)]))
    return x, y, names


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(
    batch=batches(),
    spv=st.sampled_from([None, 1, 2, 7]),
    checksum=st.sampled_from(["crc32", "xxh64", "none"]),
    order=st.randoms(use_true_random=False),
)
def test_ingest_round_trip(
    batch: tuple[np.ndarray, np.ndarray, list[str] | None], spv: int | None, checksum: str, order
) -> None:  # type: ignore[no-untyped-def]
    x, y, names = batch
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "in.npz"
        if names is None:
            np.savez(src, x=x, y=y)
        else:
            np.savez(src, x=x, y=y, class_names=np.asarray(names))
        cfg = WriterConfig(samples_per_value=spv, checksum=checksum, sync=False)  # type: ignore[arg-type]
        ingest(Path(d) / "s", open_sources([src]), config=cfg)
        n = len(x)
        idx = np.asarray([order.randrange(n) for _ in range(min(3 * n, 200))], np.int64)
        for positions in (True, False):
            with StoreReader(Path(d) / "s", positions=positions) as r:
                assert r.read_path == ("positions" if positions else "lmdb")
                want = x.astype(x.dtype.newbyteorder("<"))
                assert r.read_batch(np.arange(n)).tobytes() == want.tobytes()
                assert r.read_batch(idx).tobytes() == want[idx].tobytes()
                stored = [r.classes.index(names[c] if names else str(c)) for c in y.tolist()]
                assert r.labels().tolist() == stored
                for c in range(len(r.classes)):
                    assert r.class_indices(c).tolist() == [i for i, s in enumerate(stored) if s == c]
        assert verify_store(Path(d) / "s").ok
