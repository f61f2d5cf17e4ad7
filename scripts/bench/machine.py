"""The machine: its header (what every result names), its page cache (dropped and warmed with ``posix_fadvise``
and sequential reads), and its own limits measured in the run -- random ``pread``s at a number in flight and the
sequential read and write of a file, pages dropped first.  One definition of each; :mod:`.measures` wraps them as
measurements of a store's data file.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
#: Bytes of one sequential read or write (what ``dd bs=16M`` does).
SEQ_BLOCK = 16 << 20


# ============================================================================ the header
def header(where: Path) -> dict[str, Any]:
    """CPU, cores, RAM, the disk holding ``where``, kernel, load, versions, the commit and the date."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    versions = {}
    for dist in ("numpy", "lmdb", "torch", "tensorflow", "keras", "h5py"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[dist] = md.version(dist)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "available_gib": round(available_memory() / 2**30, 1),
        "disk": disk_of(where),
        "disk_free_gib": round(shutil.disk_usage(where).free / 2**30, 1),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
        "load": load(),
    }


def describe(h: dict[str, Any]) -> str:
    """One line of the header."""
    return (
        f"{h['cpu']}, {h['cores']} cores ({h['usable_cores']} usable), {h['ram_gib']} GiB RAM; disk {h['disk']}; "
        f"{h['kernel']}; load {h['load']} at the start, {h.get('load_end', '?')} at the end"
    )


def commit() -> str:
    """The checkout's commit, with ``+ changes`` when the library or the harness has uncommitted ones."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "lmdbstore", "cli", "scripts"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + changes" if dirty else "")


def load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def available_memory() -> int:
    """``MemAvailable`` in bytes (the RAM size where /proc does not tell)."""
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def disk_of(path: Path) -> str:
    """``<fstype> on <device>`` (and whether it spins) for the mount holding ``path``."""
    best = ("", "?", "?")
    target = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, *_ = line.split()
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    rot = ""
    with contextlib.suppress(OSError):
        spins = Path(f"/sys/block/{Path(best[1]).name}/queue/rotational").read_text().strip() == "1"
        rot = ", rotational" if spins else ", not rotational"
    return f"{best[2]} on {best[1]}{rot}"


# ============================================================================ the page cache
def files_of(paths: Iterable[Path]) -> list[Path]:
    """Every regular file at or below ``paths``."""
    out: list[Path] = []
    for p in paths:
        out += [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    return out


def drop(paths: Iterable[Path]) -> None:
    """Write back and drop the pages of every file at or below ``paths`` (pages a live process maps stay)."""
    for p in files_of(paths):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Iterable[Path]) -> bool:
    """Read every file at or below ``paths`` into the page cache when they fit in half the available memory;
    whether it did."""
    files = files_of(paths)
    if sum(p.stat().st_size for p in files) > available_memory() // 2:
        return False
    buf = bytearray(SEQ_BLOCK)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return True


def size_on_disk(path: Path) -> int:
    """Bytes of disk blocks allocated to ``path`` and everything below it."""
    return sum(p.lstat().st_blocks * 512 for p in [path, *path.rglob("*")])


# ============================================================================ the machine's limits
def pread_rate(path: Path, nbytes: int, inflight: int, seconds: float, seed: int = 0) -> float:
    """Random ``pread``\\s of ``nbytes`` at 4 KiB-aligned offsets of ``path`` (pages dropped first), ``inflight`` at a
    time, for ``seconds``: reads/s."""
    drop([path])
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offs = (np.random.default_rng(seed).integers(0, max(1, (size - nbytes) // 4096), 1 << 20) * 4096).tolist()
        done = [0] * inflight
        stop = time.perf_counter() + seconds

        def reader(k: int) -> None:
            for i in range(k, len(offs), inflight):  # at least one read each: a thread started late still counts
                os.pread(fd, nbytes, offs[i])
                done[k] += 1
                if time.perf_counter() >= stop:
                    break

        t0 = time.perf_counter()
        with ThreadPoolExecutor(inflight) as ex:
            list(ex.map(reader, range(inflight)))
        return sum(done) / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def seq_read_rate(path: Path, nbytes: int, offset: int = 0) -> float:
    """``nbytes`` of ``path`` from ``offset`` read in :data:`SEQ_BLOCK` blocks, pages dropped first: bytes/s."""
    drop([path])
    buf = np.empty(SEQ_BLOCK, np.uint8)
    view = memoryview(buf)  # type: ignore[arg-type]
    fd = os.open(path, os.O_RDONLY)
    try:
        end = min(os.fstat(fd).st_size, offset + nbytes)
        done, t0 = 0, time.perf_counter()
        while offset + done < end:
            got = os.preadv(fd, [view[: min(SEQ_BLOCK, end - offset - done)]], offset + done)
            if got <= 0:
                break
            done += got
        return done / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)


def seq_write_rate(path: Path, nbytes: int) -> float:
    """``nbytes`` of incompressible bytes written to a new file ``path`` and fsynced (the file removed): bytes/s."""
    block = np.random.default_rng(0).integers(0, 256, SEQ_BLOCK, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0, done = time.perf_counter(), 0
        while done < nbytes:
            done += os.write(fd, memoryview(block)[: min(SEQ_BLOCK, nbytes - done)])  # type: ignore[arg-type]
        os.fsync(fd)
        return done / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
        path.unlink()


class Job:
    """Another job on the machine while the block runs: a process spinning on one core."""

    def __enter__(self) -> Job:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the values (NaN-free) of per-round numbers."""
    vals = [float(v) for v in values if v == v]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": []}
    return {"median": float(np.median(vals)), "min": min(vals), "max": max(vals), "values": vals}
