"""Which epoch each pass over a batch sampler uses, and where a pass stands (docs/design.md#epochs-and-passes says
why), for every sampler built on :class:`EpochPasses`:

* A *pass* is one iteration over the sampler; it begins when its first batch is asked for (not at ``iter()``),
  with the epoch ``set_epoch`` or ``load_state_dict`` pinned since the last pass began, else the next one.
* ``state_dict()`` is ``{"epoch", "position"}`` of the latest pass plus what must match to resume (seed, batch
  size, sample count, world size, kind); ``load_state_dict`` pins that epoch and the batches to skip (unread).

Rank and world size default to ``torch.distributed``'s default process group at the time of the pass, else 0
and 1.  Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["CountedPasses", "EpochPasses", "PassIterator", "process_group"]


def process_group() -> tuple[int, int]:
    """``(rank, world size)`` of ``torch.distributed``'s default process group if one is initialized in
    this process, else ``(0, 1)``.  Never imports torch (no group can exist without it imported)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


class EpochPasses:
    """Epoch and position bookkeeping shared by the batch samplers (see the module docstring).

    A subclass calls :meth:`init_passes` in ``__init__`` and implements ``__len__`` (batches per pass on
    this rank), :meth:`batches_from` and :meth:`fingerprint`.
    """

    epoch: int

    def init_passes(self, rank: int | None, world_size: int | None) -> None:
        """Start at epoch 0, nothing begun; remember the explicit ``rank``/``world_size`` (``None``: from
        the process group at the time of each pass)."""
        if world_size is not None and world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        if rank is not None and not 0 <= rank < (world_size or 1 << 30):
            raise ValueError(f"rank must be in 0..world_size-1, got rank={rank}, world_size={world_size}")
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self._pin: tuple[int, int] | None = (0, 0)  # (epoch, batches to skip) of the next pass
        self._pass = 0  # number of the latest pass begun
        self._position = 0  # batches the latest pass has yielded

    @property
    def rank(self) -> int:
        """This process's rank: as given, else the process group's (0 without one)."""
        return self._rank if self._rank is not None else process_group()[0]

    @property
    def world_size(self) -> int:
        """Processes sharing each epoch: as given, else the process group's (1 without one)."""
        return self._world if self._world is not None else process_group()[1]

    def __len__(self) -> int:
        raise NotImplementedError

    def batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """This rank's batches of ``epoch``, from batch ``start`` on (the earlier ones are not read)."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a saved state to apply: ``kind``, ``seed``, ``batch_size``, ``samples``, and
        whatever else the order depends on (a window's size, a block order's buffer); JSON values."""
        raise NotImplementedError

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Pin the order of ``epoch`` for the next pass (every rank must pin the same epoch).  A position
        restored by :meth:`load_state_dict` for this same epoch is kept; otherwise the pass starts at its
        first batch."""
        keep = self._pin[1] if self._pin is not None and self._pin[0] == epoch else 0
        self.pin(epoch, keep)

    def pin(self, epoch: int, start: int) -> None:
        """The next pass uses ``epoch`` and begins at its batch ``start``."""
        self._pin = (int(epoch), int(start))
        self.epoch = int(epoch)

    def upcoming_epoch(self) -> int:
        """The epoch the next pass will use (nothing is claimed)."""
        return self.upcoming_pass()[0]

    def upcoming_pass(self) -> tuple[int, int]:
        """``(epoch, first batch)`` of the next pass (nothing is claimed)."""
        return self._pin if self._pin is not None else (self.epoch + 1, 0)

    def pinned_pass(self) -> tuple[int, int] | None:
        """``(epoch, first batch)`` pinned by ``set_epoch`` or ``load_state_dict`` since the last pass began
        (``None``: none)."""
        return self._pin

    def begin_pass(self) -> tuple[int, int, int]:
        """Claim the next pass: ``(pass number, epoch, first batch)`` by the rules of the module docstring."""
        if self._pin is not None:
            epoch, start = self._pin
        else:
            epoch, start = self.epoch + 1, 0
        self._pin = None
        self.epoch = epoch
        self._pass += 1
        self._position = start
        return self._pass, epoch, start

    def advanced(self, pass_number: int, position: int) -> None:
        """Record that pass ``pass_number`` has yielded ``position`` batches (ignored for an older pass)."""
        if pass_number == self._pass:
            self._position = position

    def __iter__(self) -> PassIterator:
        return PassIterator(self)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Epoch and position of the latest pass (or of the pinned one), and what must match to resume."""
        if self._pin is not None:
            epoch, position = self._pin
        else:
            epoch, position = self.epoch, self._position
        return self.state_at(epoch, position)

    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The state of a pass of ``epoch`` that has yielded ``position`` batches."""
        return {"epoch": int(epoch), "position": int(position), **self.fingerprint(), "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next pass yields the rest of that epoch's batches (after a
        finished pass: the whole next epoch).

        Raises:
            ValueError: the state is malformed or belongs to another sampler, naming what differs.
        """
        epoch, position = self.check_state(state)
        if position == len(self):
            epoch, position = epoch + 1, 0
        self.pin(epoch, position)

    def check_state(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, position)`` of a state this sampler can resume from.

        Raises:
            ValueError: as :meth:`load_state_dict`.
        """
        if not isinstance(state, dict):
            raise ValueError(f"sampler state must be a dict, got {type(state).__name__}")
        mine = {**self.fingerprint(), "world_size": self.world_size}
        for key in mine:  # every key the order depends on (a window's size too), where the state names it
            if key in state and state[key] != mine[key]:
                raise ValueError(f"sampler state is for {key} {state[key]!r}, this sampler has {mine[key]!r}")
        epoch, position = state.get("epoch"), state.get("position")
        for name, v in (("epoch", epoch), ("position", position)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"sampler state: {name} must be a non-negative integer, got {v!r}")
        assert isinstance(epoch, int) and isinstance(position, int)
        if position > len(self):
            raise ValueError(f"sampler state: position {position} is past the {len(self)} batches of an epoch")
        return epoch, position


class PassIterator(Iterator[np.ndarray]):
    """One pass over an :class:`EpochPasses` sampler; it begins at its first ``next()`` (or when a state is
    loaded into it) and is stateful itself, as torchdata's ``StatefulDataLoader`` expects."""

    def __init__(self, sampler: EpochPasses):
        self.sampler = sampler
        self.number = 0  # 0: not begun
        self.epoch = 0
        self.position = 0
        self._batches: Iterator[np.ndarray] = iter(())

    def __iter__(self) -> PassIterator:
        return self

    def _begin(self) -> None:
        self.number, self.epoch, self.position = self.sampler.begin_pass()
        self._batches = self.sampler.batches_from(self.epoch, self.position)

    def __next__(self) -> np.ndarray:
        if not self.number:
            self._begin()
        batch = next(self._batches)
        self.position += 1
        self.sampler.advanced(self.number, self.position)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """This pass's epoch and position (before it begins: the sampler's pinned ones)."""
        if not self.number:
            return self.sampler.state_dict()
        return self.sampler.state_at(self.epoch, self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make this iterator the restored pass: it begins now, at the state's epoch and position (a state
        saved at the end of a pass makes it an empty pass of that epoch, so the next pass is the one
        after)."""
        self.sampler.pin(*self.sampler.check_state(state))  # replaces any pin: this pass is the restored one
        self._begin()


class CountedPasses:
    """Pass bookkeeping for a batch sampler that keeps none (a ``torch.utils.data.BatchSampler``, a list of
    index arrays): what a feed asks of every sampler, answered by counting.  Passes are numbered from 0 (the
    "epoch" of a pass); a state is ``{"position": k, "batches": n}``, and loading it makes the next pass skip
    its first ``k`` batches unread -- exact when that pass repeats the interrupted one's batches (resuming by
    count)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._passes = 0  # passes begun
        self._skip: int | None = None  # batches the next pass skips (a loaded state), until it begins

    @property
    def batch_size(self) -> int | None:
        size = getattr(self.inner, "batch_size", None)
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    def __len__(self) -> int:
        return len(self.inner)

    def _length(self) -> int | None:
        try:
            return len(self.inner)
        except TypeError:
            return None

    def upcoming_epoch(self) -> int:
        return self._passes

    def upcoming_pass(self) -> tuple[int, int]:
        """``(pass number, first batch)`` of the next pass."""
        return self._passes, self._skip or 0

    def pinned_pass(self) -> tuple[int, int] | None:
        """The pass a loaded state pinned, until it begins (``None``: none)."""
        return None if self._skip is None else self.upcoming_pass()

    def batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The inner sampler's batches from batch ``start`` on (the earlier ones drawn, not read)."""
        it = iter(self.inner)
        for _ in range(start):
            next(it, None)
        return it

    def __iter__(self) -> Iterator[np.ndarray]:
        skip, self._skip = self._skip or 0, None
        self._passes += 1
        yield from self.batches_from(self._passes - 1, skip)

    def state_at(self, epoch: int, position: int) -> dict[str, Any]:
        """The state of a pass that has yielded ``position`` batches."""
        return {"position": int(position), "batches": self._length()}

    def state_dict(self) -> dict[str, Any]:
        return self.state_at(*self.upcoming_pass())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass skip the batches ``state`` counts (none after a finished pass).

        Raises:
            ValueError: not a ``{"position": int >= 0, "batches": int or None}`` state of a sampler of this
                length.
        """
        batches = self._length()
        if not isinstance(state, dict):
            raise ValueError(f"loader state must be a dict, got {type(state).__name__}")
        position, total = state.get("position"), state.get("batches")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise ValueError(f"loader state: position must be a non-negative integer, got {position!r}")
        if total != batches:
            raise ValueError(f"loader state is for a sampler of {total} batches, this one has {batches}")
        if batches is not None and position > batches:
            raise ValueError(f"loader state: position {position} is past the {batches} batches of a pass")
        self._skip = 0 if position == batches else position
