"""The way to the GPU for :func:`~lmdbstore.frameworks.torch_data.make_loader` (design.md, "The feed"):

* ``pin_memory=True``: the feed's slots are registered page-locked once (``cudaHostRegister``); a slot is
  written again only after the copy that read it has completed (a CUDA event: :func:`page_locking`);
* ``device="cuda"``: batch ``k + 1`` is copied on a side stream while the loop computes on batch ``k`` (:func:`stage`);
* where registration fails, a thread copies each batch into a few page-locked buffers (:class:`PinnedCopies`).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from lmdbstore.feed.feed import Fence
from lmdbstore.feed.slots import SharedSlots

__all__ = ["PageLock", "PinnedCopies", "Staging", "page_locking", "stage"]

#: Page-locked buffers of :class:`PinnedCopies`: the loop's batch, the one waiting, the one being copied, and
#: the one the loop still holds while it asks for the next.
PINNED_BUFFERS = 4
#: Seconds the copy thread sleeps while every buffer is in use, and waits at most before fresh memory instead.
BUFFER_POLL_S, BUFFER_WAIT_S = 0.0005, 0.1


class Staging:
    """Batches delivered on CUDA ``device``, copied on a side stream of their own."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)


class PageLock:
    """The feed's ``pin``: registers slot memory page-locked; ``failed`` (then :class:`PinnedCopies` copies)."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, slots: SharedSlots) -> Callable[[], None]:
        cudart = torch.cuda.cudart()
        address, nbytes = slots.address, slots.nbytes
        rc = cudart.cudaHostRegister(address, nbytes, 0)
        if int(rc) != 0:
            self.failed = True
            warnings.warn(
                f"lmdbstore: the batch slots ({nbytes / 2**20:.0f} MiB) could not be page-locked (CUDA error "
                f"{int(rc)}); batches are copied into a few page-locked buffers by a thread instead",
                RuntimeWarning,
                stacklevel=2,
            )
            return lambda: None

        def unregister() -> None:
            torch.cuda.synchronize()  # no copy may still read the memory
            cudart.cudaHostUnregister(address)

        return unregister


def page_locking(staging: Staging | None) -> tuple[Callable[[], Fence], PageLock]:
    """The feed's ``fence`` (a CUDA event recorded on the stream the copies run on: the staging stream, else
    the current one) and ``pin`` (:class:`PageLock`)."""
    stream = staging.stream if staging is not None else None

    def fence() -> Fence:
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream())
        return event  # type: ignore[no-any-return]

    return fence, PageLock()


def stage(batches: Iterator[Any], staging: Staging) -> Iterator[Any]:
    """``batches`` on ``staging.device``: each copied on the side stream one batch ahead of the loop, the loop's
    stream waiting for that batch's copy only."""
    device, stream = staging.device, staging.stream

    def put(batch: Any) -> tuple[Any, Any]:
        with torch.cuda.stream(stream):
            out = tuple(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in batch)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    try:
        ahead: tuple[Any, Any] | None = put(next(batches))
    except StopIteration:
        return
    while ahead is not None:
        batch, event = ahead
        try:
            ahead = put(next(batches))  # batch k + 1 on its way while the loop computes on batch k
        except StopIteration:
            ahead = None
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        for t in batch:
            if isinstance(t, torch.Tensor):
                t.record_stream(current)  # its memory is not reused before the loop's work on it is done
        yield batch


class PinnedCopies:
    """Batches of up to ``rows`` samples copied into :data:`PINNED_BUFFERS` page-locked buffers (``pinned=False``:
    ordinary memory, for tests) by a thread of their own: ``PinnedCopies(...)(batches)`` yields ``(x, y)``.  A
    buffer is reused once nothing references its batch and the ``fence`` recorded then has completed; a loop
    that keeps every buffer gets the next batch in memory of its own (slower, never wrong).
    """

    def __init__(
        self,
        rows: int,
        item_shape: tuple[int, ...],
        dtype: torch.dtype,
        fence: Callable[[], Fence] | None,
        *,
        pinned: bool = True,
    ):
        self.item_shape, self.dtype, self.fence = item_shape, dtype, fence
        nbytes = rows * int(np.prod(item_shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(PINNED_BUFFERS)]
        self.bases = [b.numpy() for b in self.buffers]
        self._refs = [sys.getrefcount(self.bases[k]) for k in range(len(self.bases))]  # the list and the call only
        self.free = [True] * PINNED_BUFFERS
        self.fences: dict[int, Fence] = {}

    def _take(self, stop: threading.Event) -> int | None:
        """A buffer free for the next batch: waits for one let go and copied, up to :data:`BUFFER_WAIT_S` for
        one the loop still holds (``None``: none comes, or ``stop`` is set: the batch gets fresh memory)."""
        deadline = time.monotonic() + BUFFER_WAIT_S
        while not stop.is_set():
            for k in range(len(self.bases)):
                if not self.free[k] and sys.getrefcount(self.bases[k]) <= self._refs[k]:  # let go
                    if self.fence is None:
                        self.free[k] = True
                    elif k not in self.fences:
                        self.fences[k] = self.fence()
                    elif self.fences[k].query():  # and its copy is done
                        del self.fences[k]
                        self.free[k] = True
            for k, free in enumerate(self.free):
                if free:
                    self.free[k] = False
                    return k
            if time.monotonic() > deadline:
                if not self.fences:
                    return None  # the loop keeps every buffer
                for fence in self.fences.values():  # copies under way: wait for them
                    fence.synchronize()
            else:
                time.sleep(BUFFER_POLL_S)
        return None

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        out: queue.Queue[Any] = queue.Queue(maxsize=PINNED_BUFFERS - 2)
        stop = threading.Event()
        thread = threading.Thread(target=self._copy, args=(batches, out, stop), name="lmdbstore-pin", daemon=True)
        thread.start()
        try:
            while True:
                box = [out.get()]
                if box[0] is _END:
                    return
                if isinstance(box[0], BaseException):
                    raise box.pop()
                yield box.pop()  # nothing here keeps the batch: its buffer is free once the loop lets go
        finally:
            stop.set()
            while thread.is_alive():  # unblock a put waiting for room
                with contextlib.suppress(queue.Empty):
                    out.get_nowait()
                thread.join(0.01)

    def _copy(self, batches: Iterator[Any], out: queue.Queue[Any], stop: threading.Event) -> None:
        try:
            for x, y in batches:
                k = self._take(stop)
                if stop.is_set():
                    return
                if k is None:  # every buffer held by the loop: this batch in memory of its own
                    if not _put(out, (x.clone(), y.clone()), stop):
                        return
                    del x, y
                    continue
                n = x.numel() * x.element_size()
                view = torch.from_numpy(self.bases[k][:n]).view(self.dtype).view(x.shape)
                view.copy_(x)
                item = (view, y.clone())
                del x, y, view  # the slot is free for the feed again
                if not _put(out, item, stop):
                    return
                del item  # the buffer is the loop's alone
            _put(out, _END, stop)
        except BaseException as exc:  # raised in the consumer
            _put(out, exc, stop)


_END = object()


def _put(out: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False
