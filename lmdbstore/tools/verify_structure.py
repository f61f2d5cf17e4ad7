"""``verify``'s page-structure check, and the value pass beside it, on the data file verify opened, at rest.

The structure check is py-lmdb's offline page walker (``lmdb.verify``): it reads the file with plain ``read()``
calls and never hands it to liblmdb, so a damaged file cannot crash the process.  It needs the file at rest:
:class:`AtRest` takes a shared lock on ``writer.lock`` (:func:`~lmdbstore.store.locks.hold_off_writers`), so no
writer can start, and opens the data file once.  Every check then reads that descriptor -- the walk (in this
process or a worker's, through ``/proc/self/fd``), the value pass's workers
(:class:`~lmdbstore.util.workers.PassedFd`) -- never the path again, and :meth:`AtRest.check_unchanged` and
:meth:`AtRest.check_same` make sure the file was not rewritten meanwhile and that liblmdb, opened afterwards,
shows the same file and snapshot: a store replaced while it was verified (``rm -r A && cp -r B A``, or ``cp
B/data.mdb A/data.mdb`` in place) is a one-line :class:`~lmdbstore.errors.StoreReplacedError`, never a report on
another file.

The walker reads the first page of every value's overflow run, one at a time: alone on a cold store it is
slower than reading the whole file in sequence.  So where the value pass uses worker processes or the store is
large, the walk runs at the same time in a worker process of its own, just behind the workers that bring those
pages into the page cache.  Both read only through bounds-checked ``pread``\\s, so neither needs the other's
verdict first; the value pass reads the snapshot of the newest meta page and its metadata record through
lmdbstore's own page parser (:mod:`lmdbstore.format.btree`), not liblmdb.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from lmdbstore.errors import CorruptStoreError, LmdbStoreError, StoreReplacedError
from lmdbstore.format import layout
from lmdbstore.format.btree import record_position
from lmdbstore.format.meta import StoreMeta
from lmdbstore.format.pages import LmdbMeta, PageReader, UnsupportedLayout, read_meta_page
from lmdbstore.store.env import DATA_FILE, check_count_fits
from lmdbstore.store.locks import hold_off_writers, release_lock
from lmdbstore.store.reader import StoreReader
from lmdbstore.tools.verify_values import SamplesFindings, ValueOptions, check_values, resolve_workers, value_table
from lmdbstore.util.workers import PassedFd, WorkerDied, Workers

__all__ = ["BACKGROUND_WALK_BYTES", "AtRest", "unreadable", "walk_pages"]

#: Data files from this size on are walked in a process of their own while the values are read (the walk of a
#: cold 256 MiB file alone takes about half a second; starting the process, a few tenths).
BACKGROUND_WALK_BYTES = 256 << 20
#: The walker process in messages.
WALKER = "verify's structure-check process"


def walk_pages(fd: PassedFd, path: str) -> list[str]:
    """py-lmdb's offline page walk of the data file open as ``fd`` (``path`` where ``/proc`` is not there): one
    message per problem found (none: intact)."""
    from lmdb import verify as lmdb_verify

    own = f"/proc/self/fd/{fd.fd}"  # the file this process holds, whatever the path names now
    try:
        return [str(m) for m in lmdb_verify.verify(own if os.path.exists(own) else path, subdir=False)]
    except lmdb_verify.VerifyError as exc:
        return [str(exc)]


def unreadable(exc: Exception) -> str:
    """The ``structure`` problem of a ``samples`` tree the page parser cannot read."""
    return f"the samples B-tree cannot be read: {exc.message if isinstance(exc, LmdbStoreError) else exc}"


class AtRest:
    """The data file of the store at ``path``, opened once while no writer can start (see the module docstring).

    Attributes:
        snap, meta: its newest snapshot (the meta page LMDB would pick) and metadata record, read with
            lmdbstore's own parser; ``None`` where they cannot be (the ordinary open then reports why).

    Raises:
        StoreLockedError: a writer is appending to the store.
        LmdbStoreError: ``writer.lock`` exists but cannot be opened.
    """

    def __init__(self, path: Path):
        self.path, self.data = path, path / DATA_FILE
        self.lock = hold_off_writers(path)
        try:
            self.fd = os.open(self.data, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            release_lock(self.lock)
            raise
        self.stat = os.fstat(self.fd)
        self.snap: LmdbMeta | None = None
        self.meta: StoreMeta | None = None
        try:
            size = self.stat.st_size
            snap = max((read_meta_page(self.fd, size, which, path) for which in (0, 1)), key=lambda m: m.txnid)
            pages = PageReader(self.fd, size, snap, path, None)
            off, n = record_position(pages, snap.main, layout.DB_META, layout.META_KEY)
            meta = StoreMeta.from_json(os.pread(self.fd, n, off), path=str(path))
            check_count_fits(meta, path)
            self.snap, self.meta = snap, meta
        except (LmdbStoreError, UnsupportedLayout, OSError, ValueError):
            pass

    def check(self, opts: ValueOptions, walk: bool) -> tuple[list[str], SamplesFindings | str | None]:
        """Walk the page structure (``walk``) and, meanwhile, check the values: the walk's messages, and what the
        value pass found (a string: why the ``samples`` tree cannot be read; ``None``: no snapshot to read, or the
        walk found damage first).

        Raises:
            CorruptStoreError, LmdbStoreError: the value pass failed (the data file truncated meanwhile, a worker
                process died) and the walk found the structure intact.
        """
        here = functools.partial(walk_pages, PassedFd(self.fd), str(self.data))
        if self.snap is None or self.meta is None:
            return (here() if walk else []), None
        try:
            values = value_table(self.fd, self.snap, self.path)
        except (CorruptStoreError, UnsupportedLayout) as exc:
            return (here() if walk else []), unreadable(exc)
        values_check = functools.partial(check_values, values, self.meta, self.fd, self.data, opts)
        if not walk:
            return [], values_check()
        check_bytes = int(values.sizes.sum()) if opts.checksums else 0
        if resolve_workers(opts.workers, check_bytes) <= 1 and self.stat.st_size < BACKGROUND_WALK_BYTES:
            errors = here()  # a small store: the walk first, in this process (a process would cost more)
            return errors, None if errors else values_check()
        walker = Workers(functools.partial(walk_pages, PassedFd(self.fd)), 1, "spawn", WALKER, main=False)
        try:
            walker.send(str(self.data))
            try:
                findings = values_check()
            except CorruptStoreError:
                errors = _walk_result(walker)  # a damaged structure explains it: the walk's verdict first
                if errors:
                    return errors, None
                raise
            return _walk_result(walker), findings
        finally:
            walker.close(0)

    def replaced(self) -> StoreReplacedError:
        return StoreReplacedError(
            "the data file was replaced while it was verified", path=self.path, hint="run verify again"
        )

    def check_unchanged(self) -> None:
        """Raise :meth:`replaced` where the file was written to since it was opened (no writer could: a copy over
        it) or the path names another file now."""
        now = os.fstat(self.fd)
        try:
            named = os.stat(self.data)
        except OSError:
            raise self.replaced() from None
        when = (self.stat.st_size, self.stat.st_mtime_ns, self.stat.st_ctime_ns)
        if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != when or _file_id(named) != _file_id(self.stat):
            raise self.replaced()

    def check_same(self, reader: StoreReader) -> None:
        """Raise :meth:`replaced` where ``reader`` (opened since) shows another file or snapshot than the checks."""
        h = reader._take()
        try:
            same = h.file_id == _file_id(self.stat) and (
                self.snap is None or (h.snapshot.txnid == self.snap.txnid and h.meta == self.meta)
            )
        finally:
            reader._give(h)
        if not same:
            raise self.replaced()

    def release_writers(self) -> None:
        """Let writers start again (once liblmdb's snapshot is taken); idempotent."""
        release_lock(self.lock)
        self.lock = -1

    def close(self) -> None:
        """Release the lock and the descriptor; idempotent."""
        self.release_writers()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _file_id(st: Any) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _walk_result(walker: Workers) -> list[str]:
    """The background walk's messages; its process dying or failing is a one-line error."""
    try:
        return list(walker.answer())
    except WorkerDied as exc:
        raise LmdbStoreError(exc.message, hint="out of memory, or killed? run verify again") from None
    except Exception as exc:
        raise LmdbStoreError(f"verify's structure check failed: {type(exc).__name__}: {exc}") from None
