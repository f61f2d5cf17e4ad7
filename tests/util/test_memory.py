"""What the machine can give an allocation sized by an argument (lmdbstore/util/memory.py, issue 34): read from
this machine, and the one rule -- refuse or clip, naming the parameter -- on stated machines."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from lmdbstore.util.memory import (
    MemoryBoundWarning,
    ResultBudget,
    available_memory,
    check_allocation,
    clip_bytes,
    clip_count,
    describe_bytes,
    shm_available,
)

GIB = 1 << 30


def test_this_machine() -> None:
    avail = available_memory()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < avail <= physical
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert avail <= meminfo["MemAvailable"] + (256 << 20)  # never more than the kernel says (it moves a little)
    assert 0 <= shm_available() <= available_memory() + (256 << 20)
    assert shm_available("/no/such/tmpfs") > 0  # a memfd's tmpfs: the memory itself


def test_an_allocation_beyond_the_machine_is_refused_in_one_line() -> None:
    check_allocation(4 * GIB, what="the buffers", parameter="prefetch", available=16 * GIB)  # fits in half
    with pytest.raises(ValueError) as exc:
        check_allocation(23 * GIB, what="the batch buffers", parameter="batch_size", available=22 * GIB)
    msg = str(exc.value)
    assert msg.startswith("batch_size: the batch buffers would take 23.0 GiB") and "\n" not in msg
    assert "11.0 GiB" in msg and "lower batch_size" in msg
    with pytest.raises(ValueError, match="workers"):
        check_allocation(2, what="x", parameter="workers", available=3, share=0.5)


def test_a_count_beyond_the_machine_is_clipped_with_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clip_count(100, 1 << 20, what="rows", parameter="chunk", available=GIB) == 100
        assert clip_count(1, 10 * GIB, what="rows", parameter="chunk", available=GIB) == 1  # never below minimum
        assert clip_bytes(GIB, what="a window", parameter="window_mb", available=4 * GIB) == GIB
    with pytest.warns(MemoryBoundWarning, match=r"chunk: 10,000 rows of 1\.0 MiB .* using 512"):
        assert clip_count(10_000, 1 << 20, what="rows", parameter="chunk", available=GIB) == 512
    with pytest.warns(MemoryBoundWarning, match="window_mb"):
        assert clip_bytes(10 * GIB, what="a window", parameter="window_mb", available=4 * GIB) == 2 * GIB
    assert [describe_bytes(n) for n in (512, 3 << 20, 5 * GIB, 1.5 * (1 << 40))] == [
        "512 B",
        "3.0 MiB",
        "5.0 GiB",
        "1.5 TiB",
    ]


def test_shared_memory_is_reserved_up_front(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A memfd gets its pages now; one on a tmpfs too small is a one-line error now, not a SIGBUS later."""
    import subprocess
    import sys

    from lmdbstore.util.memory import reserve

    fd = os.memfd_create("lmdbstore-test")
    try:
        reserve(fd, 1 << 20, what="batch slots", parameter="prefetch")
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)
    if os.geteuid() != 0 or sys.platform != "linux":
        pytest.skip("mounting a tmpfs needs root on Linux")
    mnt = tmp_path_factory.mktemp("tiny")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mount -t tmpfs refused here")
    try:
        fd = os.open(mnt / "slots", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(
                ValueError, match=r"prefetch: batch slots of 8\.0 MiB do not fit in shared memory"
            ) as exc:
                reserve(fd, 8 << 20, what="batch slots", parameter="prefetch")
            assert "\n" not in str(exc.value)
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_results_in_flight_are_bounded_by_their_largest() -> None:
    budget = ResultBudget(4, available=8 * GIB)  # 4 GiB for results
    assert budget.window(10**9) == 8  # two per worker until a result says how large they are
    budget.observe((np.empty(1 << 20, np.uint8), np.empty(0), None))
    assert budget.window(16) == 16  # 16 MiB in flight: fits
    budget.observe((np.empty(0), [np.empty(512 << 20, np.uint8)]))
    with pytest.warns(MemoryBoundWarning, match=r"in_flight: 10,000 task results of up to 512\.0 MiB .* keeping 8"):
        assert budget.window(10_000) == 8
