"""What the benchmarks know of the machine: its facts, its page cache, and its own limits measured in the run.

The machine the benchmarks run on is often shared and noisy, so every benchmark reports ratios against a
baseline measured in the same run; the machine's limits are measured here, one way each:

* :func:`memmap_copy_rates`: fancy-indexing random batches out of a warm ``np.load(mmap_mode="r")`` (the
  physical in-memory copy rate a loader is compared with);
* :func:`pread_rate`: random ``pread``\\s of a file whose pages were just dropped (``posix_fadvise(DONTNEED)``),
  at any number of reads in flight (1, 16 and 64 tell a disk's latency from its queue depth);
* :func:`time_cold`: a format's own reads right after its files' pages were dropped.

Not a benchmark itself: imported as ``bench.machine`` by the benchmarks beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import lmdb
import numpy as np

import lmdbstore
from bench.common import time_rounds, timed

#: Bytes of one memory page (mincore counts in them).
PAGE = os.sysconf("SC_PAGE_SIZE")


# ============================================================================ files and the page cache
def files_under(path: Path) -> list[Path]:
    """Every regular file below ``path`` (or ``path`` itself)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def allocated_bytes(path: Path) -> int:
    """Bytes of disk blocks allocated to ``path`` and everything below it (directories included)."""
    total = path.stat().st_blocks * 512
    if path.is_dir():
        for p in path.rglob("*"):
            total += p.lstat().st_blocks * 512
    return total


_libc: Any = None


def _get_libc() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        libc.syncfs.argtypes = [ctypes.c_int]
        _libc = libc
    return _libc


def resident_fraction(paths: Sequence[Path]) -> float | None:
    """Share of the files' pages that are in the page cache (mincore); ``None`` if it cannot tell."""
    try:
        libc = _get_libc()
    except OSError:
        return None
    total = resident = 0
    map_failed = ctypes.c_void_p(-1).value
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        pages = (size + PAGE - 1) // PAGE
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, map_failed):
                return None
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            libc.munmap(ctypes.c_void_p(addr), size)
            if not ok:
                return None
            resident += int((np.ctypeslib.as_array(vec) & 1).sum())
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else None


def flush_to_disk(path: Path) -> None:
    """Make everything under ``path`` durable: fsync each file, or syncfs for directories of many files."""
    paths = files_under(path)
    if len(paths) > 256:
        fd = os.open(path, os.O_RDONLY)
        try:
            _get_libc().syncfs(fd)
        finally:
            os.close(fd)
        return
    for p in [*paths, path if path.is_dir() else path.parent]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache(paths: Sequence[Path], sync: bool = False) -> None:
    """Ask the kernel to forget the files' cached pages (clean, unmapped pages only; ``sync`` writes dirty
    pages back first, so that they can go too)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            if sync:
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(paths: Sequence[Path]) -> float:
    """Read the files sequentially (into the page cache) unless they are already resident; returns seconds."""
    frac = resident_fraction(paths)
    if frac is not None and frac > 0.99:
        return 0.0
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def malloc_trim() -> None:
    """Give the heap memory this process freed back to the OS (glibc keeps it otherwise, and a resident
    size measured next would count it); a no-op where there is no ``malloc_trim``."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def rss_status() -> dict[str, float]:
    """VmRSS / RssAnon / RssFile / RssShmem / VmHWM of this process in MiB, from /proc/self/status (Linux)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0]) / 1024
    return out


# ============================================================================ host facts
def host_facts() -> dict[str, Any]:
    """Platform, Python, CPU model, logical CPUs and RAM: what every benchmark reports of its machine."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version()}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    info["cpu"] = info.get("cpu") or platform.processor() or "unknown"
    info["cores"] = os.cpu_count()
    with contextlib.suppress(ValueError, AttributeError, OSError):
        info["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return info


def usable_cores() -> int:
    """CPU cores this process may run on (affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def load_average() -> str:
    """The 1/5/15-minute load averages as text (``?`` where unknown)."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover
        return "?"


def machine_info(data_dir: Path) -> dict[str, Any]:
    """:func:`host_facts` plus the filesystem of the data directory, its free space and library versions."""
    info = host_facts()
    info["filesystem"] = _filesystem_of(data_dir)
    info["disk_free_gib"] = round(shutil.disk_usage(data_dir).free / 2**30, 1)
    versions = {"numpy": np.__version__, "lmdb (py)": lmdb.__version__, "lmdbstore": lmdbstore.__version__}
    versions["liblmdb"] = ".".join(map(str, lmdb.version()))
    versions["sqlite"] = sqlite3.sqlite_version
    for mod in ("torch", "h5py"):
        try:
            m = __import__(mod)
            versions[mod] = m.__version__
            if mod == "h5py":
                versions["hdf5"] = m.version.hdf5_version
        except ImportError:
            versions[mod] = "not installed"
    info["versions"] = versions
    info["lmdbstore_source"] = _source_state(Path(lmdbstore.__file__).resolve().parent)
    return info


def _source_state(pkg: Path) -> str:
    """Git commit of the lmdbstore sources and whether they have uncommitted changes (results depend on it)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(pkg), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(pkg), "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if commit.returncode != 0:
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty.stdout.splitlines() if line.strip()]
    return commit.stdout.strip() + (f" + uncommitted changes in {', '.join(changed)}" if changed else "")


def _filesystem_of(path: Path) -> str:
    """'<fstype> on <device> (<mount point>)' for the mount holding ``path``."""
    best = ("", "?", "?")
    target = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, *_ = line.split()
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, dev, fstype)
    rot = ""
    dev_name = Path(best[1]).name
    with contextlib.suppress(OSError):
        rot = f" (rotational={Path(f'/sys/block/{dev_name}/queue/rotational').read_text().strip()})"
    return f"{best[2]} on {best[1]}{rot} (mounted at {best[0]})"


def describe_machine(info: dict[str, Any]) -> str:
    """Five lines from :func:`machine_info`: machine, disk, OS, versions, the lmdbstore sources' commit."""
    v = info["versions"]
    return "\n".join(
        [
            f"Machine: {info['cpu']}, {info['cores']} cores, {info.get('ram_gib', '?')} GiB RAM",
            f"Disk:    {info['filesystem']}, {info['disk_free_gib']} GiB free",
            f"OS:      {info['platform']}",
            "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + f", python {info['python']}",
            f"lmdbstore source: {info.get('lmdbstore_source', 'unknown')}",
        ]
    )


# ============================================================================ cold reads and the machine's limits
class Droppable(Protocol):
    """What a cold read needs of a format: its files, and handles to close and open again."""

    def files(self) -> list[Path]: ...
    def close(self) -> None: ...
    def open(self) -> None: ...


def time_cold(
    fmt: Droppable, fn: Callable[[np.ndarray], Any], batches: Sequence[np.ndarray], max_time: float
) -> tuple[float, float | None, float | None]:
    """Random reads right after dropping the format's pages from the page cache.

    Returns (samples/s, resident share before the drop, resident share after it).  Handles are
    closed first (mapped pages cannot be dropped) and opened again before the clock starts.
    """
    fmt.close()
    paths = fmt.files()
    before = resident_fraction(paths)
    drop_page_cache(paths)
    after = resident_fraction(paths)
    fmt.open()

    def read(b: np.ndarray) -> int:
        fn(b)
        return len(b)

    return timed(batches, max_time, read), before, after


def memmap_copy_rates(npy: Path, batches: Sequence[np.ndarray], rounds: int) -> dict[str, dict[str, Any]]:
    """The physical in-memory baseline: fancy-index a warm ``np.load(mmap_mode="r")`` with each batch, as
    drawn (``"unsorted"``) and sorted (``"sorted"``, the fair one where a reader sorts its batches too);
    :func:`time_rounds` of each."""
    mm = np.load(npy, mmap_mode="r")
    float(mm[np.sort(batches[0])].sum())  # map the file and fault its first pages in outside the timing
    return {
        "unsorted": time_rounds(lambda b: mm[b], batches, rounds),
        "sorted": time_rounds(lambda b: mm[np.sort(b)], batches, rounds),
    }


def pread_rate(path: Path, nbytes: int, inflight: int, seconds: float, seed: int) -> float:
    """The disk's limit: random ``pread``\\s of ``nbytes`` at 4 KiB-aligned offsets of the file ``path``
    (written back and dropped from the page cache first), ``inflight`` at a time (a thread pool), for
    ``seconds``; returns reads/s."""
    drop_page_cache([path], sync=True)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    rng = np.random.default_rng(seed)
    offs = (rng.integers(0, (size - nbytes) // 4096, 1 << 20) * 4096).tolist()
    done = [0]
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        i = k
        while i < len(offs):  # at least one read each: a thread started late on a busy machine still counts
            os.pread(fd, nbytes, offs[i])
            done[0] += 1
            i += inflight
            if time.perf_counter() >= stop:
                break

    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight) as ex:
        list(ex.map(worker, range(inflight)))
    dt = time.perf_counter() - t0
    os.close(fd)
    return done[0] / dt


#: Bytes of one read or write of :func:`seq_read_rate` and :func:`seq_write_rate` (what ``dd bs=16M`` does).
SEQ_BLOCK = 16 << 20


def seq_read_rate(path: Path, nbytes: int | None = None, offset: int = 0) -> float:
    """The disk's sequential read limit, as ``dd`` measures it: ``nbytes`` (default: to the end) of the file
    ``path`` from ``offset``, read in :data:`SEQ_BLOCK` blocks after its pages were written back and dropped
    (``posix_fadvise(DONTNEED)``); returns bytes/s."""
    drop_page_cache([path], sync=True)
    buf = np.empty(SEQ_BLOCK, np.uint8)
    view = memoryview(buf)  # type: ignore[arg-type]  # numpy arrays are buffers
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size if nbytes is None else min(os.fstat(fd).st_size, offset + nbytes)
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
    """The disk's sequential write limit: ``nbytes`` of incompressible data written to a new file ``path`` in
    :data:`SEQ_BLOCK` blocks and fsynced (the file is left for the caller to read or remove); returns bytes/s."""
    block = np.random.default_rng(0).integers(0, 256, SEQ_BLOCK, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            done += os.write(fd, memoryview(block)[: min(SEQ_BLOCK, nbytes - done)])  # type: ignore[arg-type]
        os.fsync(fd)
        return done / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
