"""Reader processes of a feed: each reads whole batches straight into a shared-memory slot
(:mod:`lmdbstore.feed.slots`) and answers with the slot number.  numpy only.  Processes, not threads: a warm
batch is thousands of small GIL-bound copies.

A reader reads a *source* (:class:`StoreSource`: a store in a layout, its labels, a transform; the PyTorch
adapter's dataset is one too), inherited by ``fork`` or pickled for ``forkserver``/``spawn`` (checked before
any process starts: :func:`check_sendable`).  Protocol: a reader maps the slots and says ``("ready",)``; for
its ``k``-th batch the feed writes the sample numbers into the slot's label area and sends ``(slot, rows,
seed)`` to reader ``k % workers`` (a few bytes whatever the batch size; ``seed``: the batch's generators,
:mod:`lmdbstore.feed.seeding`); readers answer in order: ``("slot", slot, rows)``, ``("fresh", slot, item)``
(something else than the slot's batch, pickled) or an error (:func:`failure`: raised in the consumer as the
original exception, the reader's traceback its cause).  Readers ignore Ctrl-C and die with the consumer's
process (:mod:`lmdbstore.util.lifeline`); one that dies is a one-line :class:`~lmdbstore.errors.LmdbStoreError`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import signal
import traceback
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import numpy as np

from lmdbstore.errors import LmdbStoreError
from lmdbstore.feed.layout import BatchLayout
from lmdbstore.feed.seeding import BatchSeed, seeded
from lmdbstore.feed.slots import SegmentFd, SharedSlots
from lmdbstore.loader.transform import Transform, apply_transform
from lmdbstore.store.readers import Reader
from lmdbstore.util.lifeline import Lifeline
from lmdbstore.util.procs import check_main_guard, main_script_hidden, start_hint, start_method

__all__ = ["InlineReader", "ReaderPool", "StoreSource", "failure", "raise_failure", "serve_reads"]

#: Seconds a reader gets to stop by itself before it is terminated.
STOP_TIMEOUT = 5.0


class StoreSource:
    """What the readers read: samples of ``reader`` laid out by ``layout``, their labels (``label_table``, read
    on first use: a forked reader inherits it, a spawned one reads it again) and ``transform``, run on each
    batch where it is read (:mod:`lmdbstore.loader.transform`)."""

    def __init__(
        self, reader: Reader, layout: BatchLayout, transform: Transform | None = None, labels: np.ndarray | None = None
    ):
        self.reader, self.layout, self.transform = reader, layout, transform
        self._labels = labels

    @property
    def label_table(self) -> np.ndarray:
        """Every label of the store."""
        if self._labels is None:
            self._labels = self.reader.labels()
        return self._labels

    @property
    def user_code(self) -> bool:
        """Whether reading a batch runs the user's code (then each batch's generators are seeded)."""
        return self.transform is not None

    def payload(self) -> list[tuple[str, Any]]:
        """The user's objects the readers receive, named for an error when one cannot be pickled."""
        return [("the transform", self.transform)] if self.transform is not None else []

    def fill(self, slots: SharedSlots, slot: int, idx: np.ndarray) -> tuple[Any, ...]:
        """Read batch ``idx`` into ``slot`` and transform it: the protocol's answer."""
        rows = len(idx)
        x = slots.x(slot, rows, self.layout.item_shape, np.dtype(self.layout.dtype))
        fresh = self.read_into(x, slots.y(slot, rows), idx)
        return ("slot", slot, rows) if fresh is None else ("fresh", slot, fresh)

    def read_into(self, x: np.ndarray, y: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Read batch ``idx`` into ``x`` and its labels into ``y``, then the transform; ``None`` when the result
        is in ``x`` and ``y``, else the transform's other arrays."""
        self.layout.read(self.reader, idx, x)
        y[:] = self.label_table[idx]
        if self.transform is None:
            return None
        tx, ty, in_buffer = apply_transform(self.transform, x, y)
        if not in_buffer:
            return np.ascontiguousarray(tx), ty
        y[:] = ty
        return None

    def close(self) -> None:
        self.reader.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_labels": None}


def failure(exc: BaseException) -> tuple[Any, ...]:
    """The answer for an exception a reader raised: the exception pickled (``None`` where it cannot be sent and
    rebuilt), its type and first line, and the reader's traceback."""
    try:
        pickled: bytes | None = pickle.dumps(exc)
        pickle.loads(pickled)  # type: ignore[arg-type]
    except Exception:
        pickled = None
    text = str(exc).splitlines()[0] if str(exc) else ""
    return ("error", pickled, f"{type(exc).__name__}: {text}", "".join(traceback.format_exception(exc)))


def raise_failure(answer: tuple[Any, ...], where: str) -> NoReturn:
    """Raise a :func:`failure` answer here: the original exception (else a one-line :class:`LmdbStoreError`
    naming its type), the reader's traceback as its cause."""
    _, pickled, line, text = answer
    exc = pickle.loads(pickled) if pickled is not None else None
    if not isinstance(exc, Exception):
        exc = LmdbStoreError(f"{where} failed: {line}")
    exc.__cause__ = RemoteTraceback(text)
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"(raised in {where})")
    raise exc


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a reader process (the cause of the one raised here)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def serve_reads(
    conn: Connection, source: StoreSource, segment: SegmentFd, shape: tuple[int, int, int], lifeline: Lifeline
) -> None:
    """A reader process: answer ``(slot, rows, seed)`` requests on ``conn`` until ``None`` or end of input.
    ``shape`` is ``(slots, rows per slot, bytes per sample)`` of the shared ``segment``; the process ends
    when the owner of ``lifeline`` does."""
    lifeline.attach()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    try:
        slots = SharedSlots(*shape, segment=segment)
        source.label_table  # noqa: B018  # read before the first batch, not during it
    except Exception as exc:
        conn.send(failure(exc))
        return
    conn.send(("ready",))
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            slot, rows, seed = request
            try:
                idx = slots.y(slot, rows).copy()  # the sample numbers, where the labels go
                with seeded(seed, restore=False):
                    answer = source.fill(slots, slot, idx)
            except Exception as exc:  # sent to the consumer, raised there
                answer = failure(exc)
            conn.send(answer)
    finally:
        source.close()
        slots.close()


class InlineReader:
    """The reader "pool" without processes: reads each batch when its answer is asked for, in the
    consumer's thread (``workers=0``); the user's code runs with the batch's seeds and the consumer's own
    generators are put back afterwards."""

    def __init__(self, source: StoreSource, slots: SharedSlots):
        self.source, self.slots = source, slots
        self.pending: deque[tuple[int, np.ndarray, BatchSeed | None]] = deque()

    def submit(self, slot: int, idx: np.ndarray, seed: BatchSeed | None = None) -> None:
        self.pending.append((slot, idx, seed))

    def answer(self) -> tuple[Any, ...]:
        slot, idx, seed = self.pending.popleft()
        with seeded(seed, restore=True):
            return self.source.fill(self.slots, slot, idx)

    def drop(self) -> None:
        """Forget the requests not yet answered."""
        self.pending.clear()

    def close(self) -> None:
        self.pending.clear()


def _stop(procs: list[Any], conns: list[Connection]) -> None:
    """Ask every reader to stop, then terminate the ones that do not."""
    for c in conns:
        with contextlib.suppress(OSError, ValueError):  # already gone
            c.send(None)
    for p in procs:
        p.join(STOP_TIMEOUT)
        if p.is_alive():
            p.terminate()
            p.join(STOP_TIMEOUT)
    for c in conns:
        c.close()


def check_sendable(source: StoreSource, method: str) -> None:
    """Refuse, before any process starts, a source a ``spawn``/``forkserver`` reader cannot receive.

    Raises:
        ValueError: naming the object that cannot be pickled and what to do.
    """
    if method == "fork":
        return
    for what, obj in [*source.payload(), ("the store's reader", source)]:
        try:
            pickle.dumps(obj)
        except Exception as exc:
            raise ValueError(
                f"the reader processes start by {method} and cannot receive {what} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): make it a module-level function or class "
                "(a lambda or a function defined inside another cannot be pickled), or set the loader's "
                "multiprocessing_context to 'fork' where forking is safe"
            ) from None


class ReaderPool:
    """``workers`` reader processes over one source and one set of slots (see the module docstring).

    Args:
        source: what they read (its reader is closed here: no open environment crosses into them).
        slots: the shared slots (the caller's).
        workers: processes (at least 1).
        context: the start method (``None``: :func:`~lmdbstore.util.procs.start_method`'s choice).

    Raises:
        ValueError: the source cannot be sent to readers started by that method.
        LmdbStoreError: a reader could not open the store or the slots (its error, one line).
    """

    def __init__(self, source: StoreSource, slots: SharedSlots, workers: int, context: str | None = None):
        self.method = start_method(context)
        check_main_guard(self.method, "the reader processes")
        check_sendable(source, self.method)
        ctx = mp.get_context(self.method)
        lifeline = Lifeline.here(self.method)
        shape = (slots.n, slots.rows, source.layout.item_bytes)
        self.slots = slots
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        source.reader.close()  # no open environment crosses into the readers
        with main_script_hidden(self.method, *[obj for _, obj in source.payload()]):
            for _ in range(workers):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(  # type: ignore[attr-defined]
                    target=serve_reads, args=(theirs, source, slots.segment, shape, lifeline), daemon=True
                )
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(ours)
        self._stopper = weakref.finalize(self, _stop, self.procs, self.conns)
        for k in range(workers):
            ready = self._receive(k)
            if ready[0] == "error":
                self.close()
                raise_failure(ready, f"reader process {k}")
        self.sent = 0  # requests sent
        self.answered = 0  # answers read

    @property
    def pending(self) -> int:
        """Requests sent and not yet answered."""
        return self.sent - self.answered

    def submit(self, slot: int, idx: np.ndarray, seed: BatchSeed | None = None) -> None:
        """Send the next batch's request to its reader.

        Raises:
            LmdbStoreError: the reader died.
        """
        k = self.sent % len(self.conns)
        self.slots.y(slot, len(idx))[:] = idx  # the reader takes them from there (protocol: module docstring)
        try:
            self.conns[k].send((slot, len(idx), seed))
        except OSError:
            self._died(k)
        self.sent += 1

    def answer(self) -> tuple[Any, ...]:
        """The answer to the oldest unanswered request (waits for it).

        Raises:
            LmdbStoreError: the reader died.
        """
        k = self.answered % len(self.conns)
        answer = self._receive(k)
        self.answered += 1
        return answer

    def drop(self) -> None:
        """Wait out the requests not yet answered (their readers write into those slots) and forget them."""
        while self.pending:
            self.answer()

    def _receive(self, k: int) -> tuple[Any, ...]:
        """The next message of reader ``k`` (waits for it, watching the process)."""
        conn, proc = self.conns[k], self.procs[k]
        while not conn.poll():
            wait([conn, proc.sentinel])
            if not proc.is_alive() and not conn.poll():
                self._died(k)
        try:
            return conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            self._died(k)

    def _died(self, k: int) -> NoReturn:
        proc = self.procs[k]
        proc.join(STOP_TIMEOUT)
        raise LmdbStoreError(f"reader process {k} died (exit code {proc.exitcode})", hint=start_hint(self.method))

    def close(self) -> None:
        """Stop the readers (also done when the pool is garbage-collected)."""
        self._stopper()
