"""The ``samples`` check of ``lmdbstore verify`` at the disk's speed: every value read once, in large sequential
runs, its checksum computed by the fastest library at hand, on every core.

Every value is located from the ``samples`` B-tree (:func:`lmdbstore.format.btree.samples_positions`, never
through liblmdb); the keys and sizes alone give the grid's problems (:func:`grid_problems`); the values' bytes are
read in file order, in chunks of a few MiB (:func:`plan_chunks`), their checksums compared with their trailers
(:class:`ChunkChecker`), one chunk per worker process at a time.  The findings are reported in key order, the
first ``max_problems``, whatever the number of workers.  Memory: 25 bytes a value, one chunk buffer per worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmdbstore.errors import CorruptStoreError, LmdbStoreError
from lmdbstore.format import layout
from lmdbstore.format.btree import BTreeValues, samples_positions
from lmdbstore.format.checksums import checksum_int, trailer_dtype
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import LmdbMeta
from lmdbstore.util.memory import available_memory
from lmdbstore.util.pool import OrderedPool, TaskFailure
from lmdbstore.util.workers import PassedFd, WorkerDied

__all__ = [
    "BYTES_PER_WORKER",
    "Chunk",
    "ChunkChecker",
    "SamplesFindings",
    "ValueOptions",
    "check_values",
    "chunk_bytes",
    "grid_problems",
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


def resolve_workers(workers: int | None, check_bytes: int) -> int:
    """Processes for the checksum pass: ``workers`` when given (checked by ``verify_store``); ``None``: the cores,
    but no more than one per :data:`BYTES_PER_WORKER` of values to check (1: this process checks them itself)."""
    if workers is not None:
        return workers
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, check_bytes // BYTES_PER_WORKER))


def chunk_bytes(total: int, workers: int, largest: int, available: int | None = None) -> int:
    """Bytes a chunk covers: :data:`CHUNKS_PER_WORKER` chunks a worker at least, within
    :data:`MIN_CHUNK`..:data:`MAX_CHUNK` and :data:`MEMORY_SHARE` of ``available`` memory for all
    workers' buffers (default: now), and never less than the ``largest`` value."""
    avail = available_memory() if available is None else available
    cap = max(MIN_CHUNK, min(MAX_CHUNK, int(avail * MEMORY_SHARE) // max(workers, 1)))
    want = min(cap, max(MIN_CHUNK, total // (CHUNKS_PER_WORKER * max(workers, 1))))
    return max(want - want % ALIGN, largest)


def value_table(fd: int, snap: LmdbMeta, path: str | Path) -> BTreeValues:
    """Every value of the ``samples`` sub-database of the snapshot ``snap`` (keys, sizes, file positions).

    Raises:
        CorruptStoreError, UnsupportedLayout: the tree cannot be read (a ``structure`` problem).
    """
    return samples_positions(fd, os.fstat(fd).st_size, snap, layout.DB_SAMPLES, path=path)


# ------------------------------------------------------------------------------------------ what was found
@dataclass
class SamplesFindings:
    """What the pass over the ``samples`` sub-database found: the sorted keys of each kind of problem (``missing``,
    ``extra``, ``wrong_length`` with their ``lengths``, ``bad_checksum``), the keys on the grid ``0, spv, ... <
    count`` (``accepted``), whether ``checksums`` were compared, and whether every chunk was read (``complete``)."""

    meta: StoreMeta
    missing: np.ndarray
    extra: np.ndarray
    wrong_length: np.ndarray
    lengths: np.ndarray
    accepted: np.ndarray
    checksums: bool
    bad_checksum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    complete: bool = True

    def first(self, limit: int | None) -> list[tuple[int, str]]:
        """The first ``limit`` problems (``None``: all) in key order as ``(index, kind)``."""
        parts = [
            (self.missing[:limit], "missing-value"),
            (self.extra[:limit], "extra-value"),
            (self.wrong_length[:limit], "value-length"),
            (self.bad_checksum[:limit], "checksum"),
        ]
        return sorted((int(i), kind) for keys, kind in parts for i in keys.tolist())[:limit]

    def known_before(self, bound: int) -> int:
        """Problems at indices below ``bound`` (those later chunks cannot add to)."""
        b = np.uint64(bound)
        return sum(int(np.searchsorted(k, b)) for k in (self.missing, self.extra, self.wrong_length, self.bad_checksum))

    def message(self, index: int, kind: str) -> str:
        """The one-line message of the problem ``kind`` at ``index``."""
        m = self.meta
        if kind == "missing-value":
            return f"value of samples {index}.. is missing"
        if kind == "extra-value":
            spv = m.samples_per_value
            why = "beyond the count" if index >= m.count else f"not a multiple of samples_per_value {spv}"
            return f"unexpected sample value ({why}; count {m.count})"
        if kind == "value-length":
            have = int(self.lengths[int(np.searchsorted(self.wrong_length, np.uint64(index)))])
            return f"value has {have} bytes, expected {m.expected_value_len(index)}"
        return f"{m.checksum} mismatch in the value of samples {index}.."

    def samples_in(self, n: int) -> int:
        """Samples in the first ``n`` accepted values (the last value of the store may be short)."""
        if n == 0:
            return 0
        spv, count = self.meta.samples_per_value, self.meta.count
        return n * spv - max(0, int(self.accepted[n - 1]) + spv - count)

    def counts(self, upto: int | None = None) -> tuple[int, int, int]:
        """``(values, samples, checksums)`` checked, of the values keyed ``upto`` or below (``None``: all)."""
        n, wrong = len(self.accepted), len(self.wrong_length)
        if upto is not None:
            n = int(np.searchsorted(self.accepted, np.uint64(upto), side="right"))
            wrong = int(np.searchsorted(self.wrong_length, np.uint64(upto), side="right"))
        return n, self.samples_in(n), n - wrong if self.checksums else 0


def grid_problems(values: BTreeValues, meta: StoreMeta, checksums: bool) -> tuple[SamplesFindings, np.ndarray]:
    """The problems the keys and sizes show, and which values (by position in ``values``) are to be checksummed:
    those on the grid with the right length (none when ``checksums`` is off or the store has none)."""
    keys, spv, count = values.keys, np.uint64(meta.samples_per_value), meta.count
    on = (keys % spv == 0) & (keys < np.uint64(count))
    grid = np.zeros(meta.n_values, bool)
    grid[(keys[on] // spv).astype(np.int64)] = True
    accepted = keys[on]
    want = np.full(len(accepted), meta.samples_per_value * meta.sample_bytes + meta.trailer_bytes, np.int64)
    last = accepted + spv > np.uint64(count)
    want[last] = [meta.expected_value_len(int(k)) for k in accepted[last].tolist()]
    bad_len = values.sizes[on] != want
    compare = checksums and meta.trailer_bytes > 0
    findings = SamplesFindings(
        meta=meta,
        missing=(np.flatnonzero(~grid).astype(np.uint64) * spv),
        extra=keys[~on],
        wrong_length=accepted[bad_len],
        lengths=values.sizes[on][bad_len],
        accepted=accepted,
        checksums=compare,
    )
    check = np.flatnonzero(on)[~bad_len] if compare else np.zeros(0, np.int64)
    return findings, check


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
    """Reads a chunk of the data file open as ``fd`` and returns the positions (in the chunk) of the values whose
    checksum differs from their trailer.  Runs in a worker process (the descriptor travels with it); keeps one
    buffer of ``buffer_bytes`` for the process's life.

    Raises (from a call):
        CorruptStoreError: the data file ends before the chunk does.
    """

    def __init__(self, fd: PassedFd, kind: str, buffer_bytes: int, path: str):
        self.fd, self.kind, self.buffer_bytes, self.path = fd, kind, buffer_bytes, path
        self._buf: np.ndarray | None = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_buf": None}

    def _read(self, chunk: Chunk) -> np.ndarray:
        if self._buf is None or len(self._buf) < chunk.length:
            self._buf = np.empty(max(self.buffer_bytes, chunk.length), np.uint8)
        buf, fd = self._buf[: chunk.length], self.fd.fd
        if chunk.ahead[1] and hasattr(os, "posix_fadvise"):  # the disk reads the next chunk meanwhile
            os.posix_fadvise(fd, chunk.ahead[0], chunk.ahead[1], os.POSIX_FADV_WILLNEED)
        view, got = memoryview(buf), 0  # type: ignore[arg-type]  # numpy arrays are buffers
        while got < chunk.length:
            k = os.preadv(fd, [view[got:]], chunk.start + got)
            if k == 0:
                at = chunk.start + got
                raise CorruptStoreError(f"the data file ends at byte {at}, before the values it holds", path=self.path)
            got += k
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


def check_values(values: BTreeValues, meta: StoreMeta, fd: int, path: Path, opts: ValueOptions) -> SamplesFindings:
    """Find every problem of the ``samples`` sub-database whose values ``values`` lie in the data file open as
    ``fd`` (``path`` names it): the grid's, then the checksums' (see :class:`ValueOptions`).

    Raises:
        CorruptStoreError: the data file is shorter than its values.
        LmdbStoreError: a worker process died or failed.
    """
    if opts.total is not None:
        opts.total(meta.count)
    findings, check = grid_problems(values, meta, opts.checksums)
    total = int(values.sizes[check].sum())
    n_workers = resolve_workers(opts.workers, total)
    size = chunk_bytes(total, n_workers, int(values.sizes[check].max()) if check.size else 0)
    chunks, keys = plan_chunks(values, check, size)
    if chunks:
        checker = ChunkChecker(PassedFd(fd), meta.checksum, size, str(path))
        _run(checker, chunks, keys, findings, n_workers, opts)
    if opts.progress is not None:
        opts.progress(findings.samples_in(len(findings.accepted)))
    return findings


def _run(
    checker: ChunkChecker,
    chunks: list[Chunk],
    keys: list[np.ndarray],
    findings: SamplesFindings,
    workers: int,
    opts: ValueOptions,
) -> None:
    """Check the chunks in order, ``workers`` at a time, into ``findings.bad_checksum``."""
    lows = np.array([int(k.min()) for k in keys], np.uint64)
    later = np.minimum.accumulate(lows[::-1])[::-1]  # the smallest key any chunk from i on holds
    bad: list[np.ndarray] = []
    done, spv, count = 0, findings.meta.samples_per_value, np.uint64(findings.meta.count)
    pool = OrderedPool(checker, workers if workers > 1 else 0, IN_FLIGHT_PER_WORKER * workers, main=False)
    results = pool.results(chunks)
    try:
        for i, positions in results:
            bad.append(keys[i][positions])
            findings.bad_checksum = np.sort(np.concatenate(bad))
            done += int(np.minimum(spv, count - keys[i]).sum())
            if opts.progress is not None:
                opts.progress(done)
            bound = int(later[i + 1]) if i + 1 < len(chunks) else 2**64 - 1
            if i + 1 < len(chunks) and findings.known_before(bound) >= opts.max_problems:
                findings.complete = False
                break
    except WorkerDied as exc:
        raise LmdbStoreError(
            f"a verify worker process died (exit code {exc.exitcode})",
            path=checker.path,
            hint="out of memory, or killed? run verify again (workers=1 checks in this process)",
        ) from None
    except TaskFailure as exc:
        if isinstance(exc.error, LmdbStoreError):
            raise exc.error from None
        raise LmdbStoreError(f"a verify worker failed: {exc.type_name}: {exc.message}") from None
    finally:
        results.close()
