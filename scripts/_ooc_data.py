"""Synthetic stores for the out-of-core benchmark: cheap to generate, self-identifying samples.

Sample ``i`` is standard-normal noise (a fast RNG per batch) with element ``[0, 0]`` set to ``i`` (exact in
float32 up to 2**24), so any read can be checked for landing on the right sample without a second copy of
the data.  Labels are ``i * 7919 mod 5`` (well mixed) or, with ``sorted_classes``, one class after another
(the way a generator writes them).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from lmdbstore import WriterConfig, open_writer

SHAPE = (25, 25)
CLASSES = ["a", "b", "c", "d", "e"]
CHUNK = 1 << 16


def labels_for(lo: int, hi: int, n: int, sorted_classes: bool) -> np.ndarray:
    i = np.arange(lo, hi, dtype=np.int64)
    if sorted_classes:
        return (i * len(CLASSES) // max(n, 1)).astype(np.uint8)
    return (i * 7919 % len(CLASSES)).astype(np.uint8)


def make_store(path: Path, n: int, *, seed: int = 0, sorted_classes: bool = False, sync: bool = False) -> None:
    """Write ``n`` samples of 25x25 float32 to a new store at ``path`` with the ordinary writer."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    cfg = WriterConfig(sync=sync, initial_map_size=max(1 << 30, int(n * 2600 * 1.1)))
    with open_writer(path, shape=SHAPE, dtype="float32", classes=CLASSES, config=cfg) as w:
        for lo in range(0, n, CHUNK):
            hi = min(lo + CHUNK, n)
            x = rng.standard_normal((hi - lo, *SHAPE), dtype=np.float32)
            x[:, 0, 0] = np.arange(lo, hi, dtype=np.float32)
            w.append(x, labels_for(lo, hi, n, sorted_classes))
            if lo % (CHUNK * 64) == 0 and lo:
                print(f"  {lo:,} samples written ({(time.perf_counter() - t0):.0f} s)", flush=True)
    print(f"store of {n:,} samples written in {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", type=Path)
    ap.add_argument("--samples", type=int, required=True)
    ap.add_argument("--sorted-classes", action="store_true")
    a = ap.parse_args()
    make_store(a.path, a.samples, sorted_classes=a.sorted_classes)


if __name__ == "__main__":
    main()
