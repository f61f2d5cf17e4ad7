"""Batches in reusable buffers that leave the process stay intact: copied when shared, private after a fork.

A :class:`~lmdbstore.loader.buffers.BatchBuffers` slot is reused for a later batch once nothing in *this*
process references the batch it holds.  Another process that received the batch would see it overwritten,
so a batch never reaches another process as a view of a slot:

* **pickled** -- a ``torch.multiprocessing`` queue or pipe, a tensor sent to a spawned process, whether or
  not ``share_memory_()`` was called on it (a no-op on memory that is shared already): the reducers torch
  registers with ``multiprocessing``'s ``ForkingPickler`` for tensors and storages are wrapped so that a
  tensor or storage lying in a slot this process has handed out is reduced as a ``clone()``.  The receiver
  gets its own copy; everything else is reduced exactly as torch does.
* **inherited** -- a child forked while the batch is held (``Process(target, args=(x,))`` with fork, a
  forked pool): right after the fork the child makes its copy of every handed-out slot private
  (:func:`lmdbstore.util.forking.privatize`), as fork does for ordinary memory, and the parent waits for it
  to confirm before going on (a slot the child does not confirm is never reused).  The loader's own
  workers are forked before any of their buffers is handed out, so they keep sharing them.

The set of live buffers is process-wide state (a weak set), as ``ForkingPickler``'s reducer table and what
``fork()`` copies are process-wide.
"""

from __future__ import annotations

import contextlib
import os
import select
import warnings
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch
import torch.multiprocessing  # registers torch's reducers first, so that the ones below replace them
from torch.multiprocessing.reductions import reduce_storage, reduce_tensor, reduce_typed_storage

from lmdbstore.util.forking import privatize, supported

__all__ = ["HandedOut", "held_by_this_process", "track"]


class HandedOut(Protocol):
    """What this module needs of a set of buffers: the slots it has handed out and their memory, and a way
    to never reuse one."""

    owner_pid: int

    def held_slots(self) -> Iterator[tuple[int, tuple[int, int]]]: ...

    def pin(self, slot: int) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def track(buffers: HandedOut) -> None:
    """Watch ``buffers`` (created in this process) for as long as it lives."""
    _LIVE.add(buffers)


def _held_ranges() -> list[tuple[int, int]]:
    pid = os.getpid()
    return [r for b in list(_LIVE) if b.owner_pid == pid for _, r in b.held_slots()]


def held_by_this_process(ptr: int) -> bool:
    """Whether the address ``ptr`` lies in a slot this process has handed out (and may reuse)."""
    return any(start <= ptr < start + n for start, n in _held_ranges())


def _storage_ptr(obj: Any) -> int:
    with contextlib.suppress(Exception):
        return int(obj.data_ptr())
    return 0


def _reduce_tensor(t: torch.Tensor) -> Any:
    if t.device.type == "cpu" and held_by_this_process(_storage_ptr(t.untyped_storage())):
        t = t.clone()
    return reduce_tensor(t)


def _copying(reduce: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A storage reducer that reduces a copy of a storage lying in a handed-out slot (else as ``reduce``)."""

    def reducer(storage: Any) -> Any:
        untyped = getattr(storage, "_untyped_storage", storage)  # TypedStorage's own API warns when used
        if untyped.device.type == "cpu" and held_by_this_process(_storage_ptr(untyped)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                storage = storage.clone()
        return reduce(storage)

    return reducer


class _Fork:
    """The slots handed out when a fork began, and the pipe the child confirms their privatization on."""

    def __init__(self, held: list[tuple[Any, int, int, int]]):
        self.held = held  # (buffers, slot, address, bytes)
        self.r, self.w = os.pipe()


#: The fork in progress, if slots were handed out when it began (set and cleared around each fork).
_FORK: list[_Fork] = []


def _before_fork() -> None:
    pid = os.getpid()
    held = [(b, slot, start, n) for b in list(_LIVE) if b.owner_pid == pid for slot, (start, n) in b.held_slots()]
    if held and supported():
        _FORK.append(_Fork(held))


def _in_child() -> None:
    """In the new child: make each handed-out slot private to it, then tell the parent."""
    if not _FORK:
        return
    fork = _FORK.pop()
    ok = True
    for _, _, start, n in fork.held:
        try:
            privatize(start, start + n)
        except (OSError, ValueError):
            ok = False
    with contextlib.suppress(OSError):
        os.write(fork.w, b"1" if ok else b"0")
    for fd in (fork.r, fork.w):
        with contextlib.suppress(OSError):
            os.close(fd)


def _in_parent() -> None:
    """In the parent: wait (bounded) until the child has made the slots private; unconfirmed slots are
    never reused (a child that died or could not privatize them may still see them)."""
    if not _FORK:
        return
    fork = _FORK.pop()
    os.close(fork.w)
    try:
        ready, _, _ = select.select([fork.r], [], [], FORK_CONFIRM_S)
        ok = bool(ready) and os.read(fork.r, 1) == b"1"
    finally:
        os.close(fork.r)
    if not ok:
        for b, slot, _, _ in fork.held:
            b.pin(slot)


#: How long the parent waits for a forked child to confirm it made the handed-out slots private.
FORK_CONFIRM_S = 30.0


ForkingPickler.register(torch.Tensor, _reduce_tensor)
ForkingPickler.register(torch.UntypedStorage, _copying(reduce_storage))
ForkingPickler.register(torch.storage.TypedStorage, _copying(reduce_typed_storage))
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_in_child, after_in_parent=_in_parent)
