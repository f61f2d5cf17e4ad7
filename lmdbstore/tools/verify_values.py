"""The ``samples`` check of ``lmdbstore verify`` at the disk's speed: every value read once, in large sequential
runs, its checksum computed by the fastest library at hand, in ``workers`` processes.

liblmdb's cursor faults a value's pages in one at a time, so checking a cold store through it ran at ~130 MB/s
of one core (issue 36).  This pass instead:

1. locates every value from the ``samples`` B-tree (:func:`lmdbstore.format.btree.samples_positions`, a
   bounds-checked walk that never hands the file to liblmdb);
2. finds from the keys and sizes alone what the cursor walk would report as ``missing-value``, ``extra-value``
   and ``value-length`` (:func:`~lmdbstore.tools.verify_findings.grid_problems`);
3. reads the values' bytes in file order, in chunks of a few MiB (:func:`plan_chunks`, sized by the data and
   the memory available), and compares each value's checksum with its trailer (:class:`ChunkChecker`), one
   chunk per worker process at a time (:func:`check_values`, on :class:`~lmdbstore.util.workers.OrderedPool`).

What it finds (:class:`~lmdbstore.tools.verify_findings.SamplesFindings`) is reported exactly as the cursor walk of
:class:`~lmdbstore.tools.verify_checks.ContentChecks` reports it -- the same problems in key order, the same
messages and counters, also when ``max_problems`` stops the report early -- whatever the number of workers
(tests compare them).  A tree this walk cannot read (a key of another width, an unknown page layout) is left
to the cursor walk (:func:`value_table` returns ``None``).  Memory: the value table (25 bytes a value) in the
calling process, one chunk buffer per worker.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmdbstore.errors import CorruptStoreError, LmdbStoreError
from lmdbstore.format import layout
from lmdbstore.format.btree import BTreeValues, samples_positions
from lmdbstore.format.checksums import checksum_int, trailer_dtype
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import LmdbMeta, UnsupportedLayout
from lmdbstore.loader.window import available_memory
from lmdbstore.tools.verify_findings import SamplesFindings, grid_problems
from lmdbstore.util.procs import main_script_hidden
from lmdbstore.util.workers import OrderedPool, TaskFailure, WorkerDied

__all__ = [
    "BYTES_PER_WORKER",
    "Chunk",
    "ChunkChecker",
    "ValueOptions",
    "check_values",
    "chunk_bytes",
    "plan_chunks",
    "resolve_workers",
    "value_table",
]

#: Bytes of values each worker process should have to check for it to be worth starting (0.3-1 s each: it
#: imports lmdbstore; one process checks about 1 GB/s of a cold store on the development machine).
BYTES_PER_WORKER = 512 << 20
#: Bounds of one chunk (one read): large sequential runs, never more than this much memory a worker.
MIN_CHUNK = 1 << 20
MAX_CHUNK = 32 << 20
#: Share of the available memory all workers' chunk buffers together may take.
MEMORY_SHARE = 1 / 16
#: Chunks per worker at least, so that work spreads evenly and a stop after ``max_problems`` comes early.
CHUNKS_PER_WORKER = 4
#: Chunks submitted to each worker and not yet reported (back-pressure: the tasks are small).
IN_FLIGHT_PER_WORKER = 2
#: Where a read starts (reads aligned to pages go straight through the page cache).
ALIGN = 4096


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def resolve_workers(workers: int | None, check_bytes: int) -> int:
    """Processes for the checksum pass: ``workers`` when given; ``None``: the cores, but no more than one per
    :data:`BYTES_PER_WORKER` of values to check (1: this process checks them itself).

    Raises:
        ValueError: ``workers`` below 1.
    """
    if workers is not None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        return workers
    return max(1, min(usable_cores(), check_bytes // BYTES_PER_WORKER))


def chunk_bytes(total: int, workers: int, largest: int, available: int | None = None) -> int:
    """Bytes a chunk covers: :data:`CHUNKS_PER_WORKER` chunks a worker at least, within
    :data:`MIN_CHUNK`..:data:`MAX_CHUNK` and :data:`MEMORY_SHARE` of ``available`` memory for all
    workers' buffers (default: now), and never less than the ``largest`` value."""
    avail = available_memory() if available is None else available
    cap = max(MIN_CHUNK, min(MAX_CHUNK, int(avail * MEMORY_SHARE) // max(workers, 1)))
    want = min(cap, max(MIN_CHUNK, total // (CHUNKS_PER_WORKER * max(workers, 1))))
    return max(want - want % ALIGN, largest)


# ------------------------------------------------------------------------------------------ the value table
def value_table(fd: int, snap: LmdbMeta, path: str | Path) -> BTreeValues | None:
    """Every value of the ``samples`` sub-database of the snapshot ``snap`` (keys, sizes, file positions), or
    ``None`` where the walk cannot read the tree (a key of another width, a damaged tree: the cursor walk then
    reports what liblmdb sees)."""
    try:
        return samples_positions(fd, os.fstat(fd).st_size, snap, layout.DB_SAMPLES, path=path)
    except (CorruptStoreError, UnsupportedLayout):
        return None


# ------------------------------------------------------------------------------------------ chunks
@dataclass(frozen=True)
class Chunk:
    """One read of the pass: ``length`` bytes of the data file from ``start``; the values in it at offsets
    ``rel`` (from ``start``), each ``lens`` bytes long with its trailer.  ``ahead``: the next chunk's
    ``(start, length)`` in file order (``(0, 0)``: none), whose reading the disk may start meanwhile."""

    start: int
    length: int
    rel: np.ndarray  # int64
    lens: np.ndarray  # int64
    ahead: tuple[int, int] = (0, 0)


def plan_chunks(values: BTreeValues, check: np.ndarray, size: int) -> tuple[list[Chunk], list[np.ndarray]]:
    """Split the values ``check`` (positions in ``values``) into chunks of about ``size`` bytes in file order;
    returns the chunks and, for each, the keys of its values (in the chunk's order)."""
    if check.size == 0:
        return [], []
    order = check[np.argsort(values.pos[check], kind="stable")]
    pos, lens = values.pos[order], values.sizes[order]
    base = int(pos[0]) - int(pos[0]) % ALIGN
    cut = np.flatnonzero(np.diff((pos - base) // size)) + 1
    parts = np.split(np.arange(len(order)), cut)
    spans = []
    for part in parts:
        start = int(pos[part[0]]) - int(pos[part[0]]) % ALIGN
        spans.append((start, int((pos[part] + lens[part]).max()) - start))
    chunks = [
        Chunk(start, length, pos[part] - start, lens[part], spans[i + 1] if i + 1 < len(spans) else (0, 0))
        for i, (part, (start, length)) in enumerate(zip(parts, spans, strict=True))
    ]
    return chunks, [values.keys[order[part]] for part in parts]


class ChunkChecker:
    """Reads a chunk of the data file and returns the positions (in the chunk) of the values whose checksum
    differs from their trailer.  Runs in a worker process (picklable: a path, the file's identity, a kind);
    keeps one buffer of ``buffer_bytes`` for the process's life.

    Raises (from a call):
        CorruptStoreError: the data file is no longer the one verified, or ends before the chunk does.
    """

    def __init__(self, data_path: str, file_id: tuple[int, int], kind: str, buffer_bytes: int):
        self.data_path, self.file_id, self.kind, self.buffer_bytes = data_path, file_id, kind, buffer_bytes
        self._buf: np.ndarray | None = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_buf": None}

    def _read(self, chunk: Chunk) -> np.ndarray:
        if self._buf is None or len(self._buf) < chunk.length:
            self._buf = np.empty(max(self.buffer_bytes, chunk.length), np.uint8)
        buf = self._buf[: chunk.length]
        fd = os.open(self.data_path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.file_id:
                raise CorruptStoreError("the data file was replaced while it was verified", path=self.data_path)
            if chunk.ahead[1] and hasattr(os, "posix_fadvise"):  # the disk reads the next chunk meanwhile
                os.posix_fadvise(fd, chunk.ahead[0], chunk.ahead[1], os.POSIX_FADV_WILLNEED)
            view, got = memoryview(buf), 0  # type: ignore[arg-type]  # numpy arrays are buffers
            while got < chunk.length:
                k = os.preadv(fd, [view[got:]], chunk.start + got)
                if k == 0:
                    raise CorruptStoreError(
                        f"the data file ends at byte {chunk.start + got}, before the values it holds",
                        path=self.data_path,
                    )
                got += k
        finally:
            os.close(fd)
        return buf

    def __call__(self, chunk: Chunk) -> np.ndarray:
        buf = self._read(chunk)
        fn, dt = checksum_int(self.kind), trailer_dtype(self.kind)
        assert fn is not None  # chunks are planned only for stores with checksums
        pay = chunk.lens - dt.itemsize
        view = memoryview(buf)  # type: ignore[arg-type]
        got = np.fromiter(
            (fn(view[o : o + n]) for o, n in zip(chunk.rel.tolist(), pay.tolist(), strict=True)),
            np.uint64,
            count=len(pay),
        )
        at = (chunk.rel + pay)[:, None] + np.arange(dt.itemsize)
        want = buf[at].view(dt).reshape(-1).astype(np.uint64)
        return np.flatnonzero(got != want)


# ------------------------------------------------------------------------------------------ the pass
@dataclass(frozen=True)
class ValueOptions:
    """How the value pass runs (see :func:`check_values`): compare ``checksums``; in ``workers`` processes
    (:func:`resolve_workers`); stop once the first ``max_problems`` problems are known; ``progress(done)``
    after each chunk; ``total(count)`` once, before the first ``progress`` call."""

    checksums: bool
    workers: int | None
    max_problems: int
    progress: Callable[[int], None] | None = None
    total: Callable[[int], None] | None = None


def check_values(values: BTreeValues, meta: StoreMeta, data_path: Path, fd: int, opts: ValueOptions) -> SamplesFindings:
    """Find every problem of the ``samples`` sub-database whose values ``values`` lie in the data file ``fd``
    (at ``data_path``): the grid's, then the checksums' (see :class:`ValueOptions`).

    Raises:
        CorruptStoreError: the data file was replaced or is shorter than its values.
        LmdbStoreError: a worker process died or failed.
        ValueError: ``workers`` below 1.
    """
    if opts.total is not None:
        opts.total(meta.count)
    findings, check = grid_problems(values, meta, opts.checksums)
    total = int(values.sizes[check].sum())
    n_workers = resolve_workers(opts.workers, total)
    largest = int(values.sizes[check].max()) if check.size else 0
    size = chunk_bytes(total, n_workers, largest)
    chunks, keys = plan_chunks(values, check, size)
    if chunks:
        st = os.fstat(fd)
        checker = ChunkChecker(str(data_path), (st.st_dev, st.st_ino), meta.checksum, size)
        bad = _run(checker, chunks, keys, findings, n_workers, opts.max_problems, opts.progress)
        findings.bad_checksum = np.sort(np.concatenate(bad)) if bad else findings.bad_checksum
    if opts.progress is not None:
        opts.progress(findings._samples_in(len(findings.accepted)))
    return findings


def _samples(keys: np.ndarray, meta: StoreMeta) -> int:
    """Samples in the values keyed ``keys``."""
    spv = meta.samples_per_value
    return int(np.minimum(spv, np.uint64(meta.count) - keys).sum())


def _run(
    checker: ChunkChecker,
    chunks: list[Chunk],
    keys: list[np.ndarray],
    findings: SamplesFindings,
    workers: int,
    max_problems: int,
    progress: Callable[[int], None] | None,
) -> list[np.ndarray]:
    """Check the chunks in order, ``workers`` at a time; the keys of the values that failed, per chunk done."""
    lows = np.array([int(k.min()) for k in keys], np.uint64)
    later = np.minimum.accumulate(lows[::-1])[::-1]  # the smallest key any chunk from i on holds
    bad: list[np.ndarray] = []
    done = 0
    pool = OrderedPool(checker, workers if workers > 1 else 0, IN_FLIGHT_PER_WORKER * workers)
    results = pool.results(chunks)
    try:
        with main_script_hidden("spawn"):  # the workers start on the first result: they need nothing of __main__
            head = next(results)
        for i, positions in itertools.chain([head], results):
            bad.append(keys[i][positions])
            findings.bad_checksum = np.sort(np.concatenate(bad))
            done += _samples(keys[i], findings.meta)
            if progress is not None:
                progress(done)
            bound = int(later[i + 1]) if i + 1 < len(chunks) else 2**64 - 1
            if i + 1 < len(chunks) and findings.known_before(bound) >= max_problems:
                findings.complete = False
                break
    except WorkerDied as exc:
        raise LmdbStoreError(
            f"a verify worker process died (exit code {exc.exitcode})",
            path=checker.data_path,
            hint="out of memory, or killed? run verify again (workers=1 checks in this process)",
        ) from None
    except TaskFailure as exc:
        cause = exc.__cause__
        if isinstance(cause, LmdbStoreError):  # in this process: the error itself
            raise cause from None
        if exc.type_name == "CorruptStoreError":
            raise CorruptStoreError(exc.message, hint="run verify again") from None
        raise LmdbStoreError(f"a verify worker failed: {exc.type_name}: {exc.message}") from None
    finally:
        results.close()
    return bad
