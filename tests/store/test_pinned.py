"""One reader shared by threads (lmdbstore.store.pinned): snapshots replaced and handles closed under a lock, a
handle closed only when no read on it is in progress.  Issue 25 #10: four threads sharing a reader beside a
writer used to get false "Bad file descriptor -- check the disk" errors."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import build_store, make_data

from lmdbstore import StoreReader, StoreSet, WriterConfig, open_writer

THREADS = 4


def _hammer(reader: StoreReader | StoreSet, x: np.ndarray, y: np.ndarray, n: int, stop: threading.Event) -> list:
    """Threads reading random and block batches and labels of the first ``n`` samples until ``stop``."""
    errors: list[BaseException] = []
    reads = [0] * THREADS

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        try:
            while not stop.is_set() or reads[k] < 3:
                idx = (
                    rng.integers(0, n, 200)
                    if reads[k] % 2
                    else np.arange(lo := int(rng.integers(0, n - 200)), lo + 200)
                )
                np.testing.assert_array_equal(reader.read_batch(idx), x[idx])
                np.testing.assert_array_equal(reader.labels_of(idx), y[idx])
                reads[k] += 1
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    return [threads, errors, reads]


@pytest.mark.parametrize("lock", [None, False, True])
def test_four_threads_share_a_reader_beside_a_writer(tmp_path: Path, lock: bool | None) -> None:
    x, y = make_data(2400, seed=21)
    path = build_store(tmp_path / "s", x[:1000], y[:1000])
    r = StoreReader(path, lock=lock).open()
    stop = threading.Event()
    threads, errors, reads = _hammer(r, x, y, 1000, stop)
    # a writer in this process: the shared environment is re-opened writable under the readers, every commit
    # may end their snapshots (lock-free ones see it through the meta page)
    with open_writer(path, config=WriterConfig(commit_bytes=1 << 20)) as w:
        for k in range(1000, 2400, 100):
            w.append(x[k : k + 100], y[k : k + 100])
            w.commit()
            if k == 1700:
                r.close()  # closed under the threads: they finish their reads, then re-open
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, [str(e) for e in errors]
    assert min(reads) >= 3
    r.refresh()
    np.testing.assert_array_equal(r.read_batch(np.arange(2400)), x)
    r.close()


def test_threads_share_a_set(tmp_path: Path) -> None:
    xa, ya = make_data(700, seed=22)
    xb, yb = make_data(500, seed=23)
    s = StoreSet([build_store(tmp_path / "a", xa, ya), build_store(tmp_path / "b", xb, yb)]).open()
    stop = threading.Event()
    threads, errors, _ = _hammer(s, np.concatenate([xa, xb]), np.concatenate([ya, yb]), 1200, stop)
    s.close()  # closed under the threads: they re-open
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, [str(e) for e in errors]
    s.close()
