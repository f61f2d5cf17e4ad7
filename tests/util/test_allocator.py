"""lmdbstore.util.allocator: large blocks kept for reuse where Dask's MALLOC_TRIM_THRESHOLD_ pins glibc (issue 28).

Each case runs in a fresh interpreter (the setting is per process and the variable is read by glibc at start):
with the variable set as Dask sets it, a producer's 10 MB temporaries fault their pages in on every
allocation until :func:`keep_large_blocks` runs, and hardly at all after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

PROBE = """
import json, resource
import numpy as np
from lmdbstore.util.allocator import keep_large_blocks

def faults_per_temporary():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        a = np.ones(2_560_000, np.float32)  # a 10 MB batch's temporary
        del a
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20

pinned = faults_per_temporary()
kept = keep_large_blocks()
again = keep_large_blocks()
faults_per_temporary()  # the first one after the change grows the heap
print(json.dumps({"kept": kept, "again": again, "pinned": pinned, "after": faults_per_temporary()}))
"""


def _probe(**env: str) -> dict[str, float]:
    base = {k: v for k, v in os.environ.items() if k not in ("MALLOC_TRIM_THRESHOLD_", "LMDBSTORE_KEEP_MALLOC")}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_under_dasks_setting_large_temporaries_stop_faulting_their_pages_in() -> None:
    out = _probe(MALLOC_TRIM_THRESHOLD_="65536")
    assert out["kept"] is True and out["again"] is True
    assert out["pinned"] > 100  # mapped afresh each time (2,500 pages of 4 KiB; fewer with huge pages)
    assert out["after"] < out["pinned"] / 10, out


def test_without_the_variable_the_allocator_is_left_alone() -> None:
    out = _probe()
    assert out["kept"] is False
    assert out["after"] < 10  # glibc's dynamic threshold keeps them by itself


def test_the_opt_out_leaves_dasks_setting_in_place() -> None:
    out = _probe(MALLOC_TRIM_THRESHOLD_="65536", LMDBSTORE_KEEP_MALLOC="0")
    assert out["kept"] is False
    assert out["after"] > 100
