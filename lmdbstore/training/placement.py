"""Where the training data lives across the ranks of a ``torchrun`` job: the same stores on every node (a copy per
node), or each node with its own shards of a set (docs/multinode.md).

The ranks compare their stores' metadata (:func:`place`, one ``all_gather``).  Ranks holding the same stores
form a *group* that shares them round-robin; all ranks train on one class list (the union, labels mapped by
name) and run the same number of steps (:class:`EqualSteps`), on samples of one shape and dtype.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lmdbstore.config import LoaderConfig
from lmdbstore.errors import ValidationError
from lmdbstore.loader.choose import SplitRecord, make_sampler_for, run_split
from lmdbstore.loader.passes import EpochPasses
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.readers import Reader
from lmdbstore.training.data import TrainData, check_inputs, read_store
from lmdbstore.training.distributed import DistInfo
from lmdbstore.training.metrics import Log
from lmdbstore.training.order import Order, agree_order

__all__ = [
    "EqualSteps",
    "Placement",
    "RankData",
    "equal_steps",
    "fingerprint",
    "gather",
    "place",
    "rank_data",
    "shard_data",
    "split_sizes",
]


@dataclass(frozen=True)
class Placement:
    """This rank's share of the data: its rank and world size in its group (``share``), the number of
    ``groups`` (1: the same stores everywhere), the ``classes`` every rank trains on, the job's ranks of its group
    and its place in the whole job (``job``: rank, world size, local rank)."""

    share: DistInfo
    groups: int
    classes: list[str]
    group_ranks: tuple[int, ...]
    job: tuple[int, int, int] = (0, 1, 0)  #: the job's own rank, world size and local rank

    @property
    def sharded(self) -> bool:
        """Different data on different ranks."""
        return self.groups > 1


def fingerprint(reader: Reader) -> str:
    """What identifies a rank's data: a digest of every store's metadata (counts, classes, times, statistics)
    without its store id, equal for copies of the same stores wherever they are (``lmdbstore copy`` gives a copy
    its own store id: the id names a file, not its samples)."""
    readers = reader.readers if isinstance(reader, StoreSet) else [reader]
    h = hashlib.sha256()
    for r in readers:
        h.update(r.meta.with_(store_id="").to_json())
    return h.hexdigest()


def place(reader: Reader, info: DistInfo) -> Placement:
    """Compare the ranks' data (see the module docstring) and return this rank's :class:`Placement`.

    Raises:
        ValidationError: ranks hold samples of different shapes or dtypes.
    """
    mine = (fingerprint(reader), list(reader.classes), list(reader.shape), str(reader.dtype))
    if not info.active:
        return Placement(info, 1, mine[1], (0,), _job(info))
    every = gather(mine, info)
    for rank, (_, _, shape, dtype) in enumerate(every):
        if (shape, dtype) != (mine[2], mine[3]):
            raise ValidationError(
                f"rank {rank} reads samples of shape {tuple(shape)} {dtype}, this rank {tuple(mine[2])} {mine[3]}",
                path=reader.path,
                hint="give every node stores of one sample shape and dtype",
            )
    prints = list(dict.fromkeys(e[0] for e in every))
    if len(prints) == 1:
        return Placement(info, 1, mine[1], tuple(range(info.world_size)), _job(info))
    members = tuple(r for r, e in enumerate(every) if e[0] == mine[0])
    classes = list(dict.fromkeys(c for e in every for c in e[1]))
    share = DistInfo(members.index(info.rank), len(members), info.local_rank)
    return Placement(share, len(prints), classes, members, _job(info))


def _job(info: DistInfo) -> tuple[int, int, int]:
    return info.rank, info.world_size, info.local_rank


def gather(value: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` for one process)."""
    if not info.active:
        return [value]
    every: list[Any] = [None] * info.world_size
    dist.all_gather_object(every, value)
    return every


def equal_steps(steps: int, info: DistInfo) -> int:
    """The largest of the ranks' ``steps`` (every rank runs that many)."""
    return max(int(s) for s in gather(steps, info))


def split_sizes(placement: Placement, n_train: int, n_val: int, info: DistInfo) -> tuple[int, int]:
    """The job's training and validation samples: each group's split counted once.

    Raises:
        ValidationError: some shards have validation samples and others none (the ranks would run validation
            unequally).
    """
    every = gather((n_train, n_val, placement.share.world_size), info)
    if any(v == 0 for _, v, _ in every) and any(v > 0 for _, v, _ in every):
        raise ValidationError(
            "some nodes' shards have no validation samples and others do",
            hint="raise val_fraction=, or give every node shards of about the same size",
        )
    return round(sum(t / w for t, _, w in every)), round(sum(v / w for _, v, w in every))


class EqualSteps(EpochPasses):
    """The batches of ``inner``, cut to exactly ``steps`` per epoch by halving its largest batches (every sample
    still once); its states count the cut batches and say ``steps`` (a state without it is taken for these).

    Raises (when iterated):
        ValidationError: fewer samples than ``steps`` this epoch (a shard far smaller than the others).
    """

    def __init__(self, inner: Any, steps: int) -> None:
        self.inner, self.steps = inner, steps
        self.init_passes(None, None)

    def __len__(self) -> int:
        return self.steps

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return int(self.inner.world_size)

    def batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        batches = [np.asarray(b) for b in self.inner.batches_from(epoch, 0)]
        if sum(len(b) for b in batches) < self.steps:
            raise ValidationError(
                f"this rank's shard holds fewer samples than the {self.steps} steps the largest shard needs",
                hint="give every node shards of about the same size",
            )
        while len(batches) < self.steps:
            k = max(range(len(batches)), key=lambda i: len(batches[i]))
            half = len(batches[k]) // 2
            batches[k : k + 1] = [batches[k][:half], batches[k][half:]]
        return iter(batches[start:])

    def fingerprint(self) -> dict[str, Any]:
        return {**self.inner.fingerprint(), "steps": self.steps}

    def check_state(self, state: dict[str, Any]) -> tuple[int, int]:
        if isinstance(state, dict) and state.get("steps", self.steps) != self.steps:
            raise ValueError(f"sampler state is for {state['steps']!r} steps an epoch, this sampler has {self.steps}")
        return super().check_state(state)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "steps"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def shard_data(data: TrainData, placement: Placement) -> TrainData:
    """``data`` with the job's class list when the ranks hold different shards (labels mapped by name);
    unchanged otherwise."""
    if not placement.sharded or data.classes == placement.classes:
        return data
    readers = data.reader.readers if isinstance(data.reader, StoreSet) else [data.reader]
    return read_store(StoreSet(readers, classes=placement.classes))


@dataclass(frozen=True)
class RankData:
    """What this rank trains and validates on (:func:`rank_data`): ``sizes`` are the job's training and
    validation samples, ``splits`` the records of every group's split as JSON (what checkpoints keep)."""

    data: TrainData
    placement: Placement
    train_idx: np.ndarray
    val_idx: np.ndarray
    sampler: Any
    sizes: tuple[int, int]
    splits: str = "[]"

    def val_batches(self, sampler: Any) -> Any:
        """The validation sampler with as many steps as on every other rank (when sharded)."""
        if not self.placement.sharded:
            return sampler
        return EqualSteps(sampler, equal_steps(len(sampler), DistInfo(*self.placement.job)))


def rank_data(
    data: TrainData,
    val_fraction: float,
    lcfg: LoaderConfig,
    info: DistInfo,
    say: Log,
    device: torch.device | None = None,
    recorded: Order | None = None,
    splits: Sequence[SplitRecord] | None = None,
) -> RankData:
    """The trainer's data steps: place the data, split it (``splits``: a resumed run's records, kept exactly),
    check it, fix the run's order on every rank (``recorded``: a resumed run's; exchanged on ``device``, default
    the CPU) and make this rank's sampler (cut to equal steps when sharded).

    Raises:
        ValidationError: as :func:`place`, :func:`split_sizes` and ``check_inputs``.
        LmdbStoreError: no record of ``splits`` is of this data (the store changed since the run).
    """
    placement = place(data.reader, info)
    data, share = shard_data(data, placement), placement.share
    if splits is None:
        split = SplitRecord.drawn(data.labels, val_fraction, lcfg.seed)
    else:
        split = run_split(splits, data.labels, data.path)
        if split.samples < len(data.labels):
            say(f"the store grew since the run split its first {split.samples} samples: the run keeps that split")
    train_idx, val_idx = split.parts(data.labels)
    every = gather(asdict(split), info)
    records = json.dumps([r for k, r in enumerate(every) if r not in every[:k]])
    sizes = split_sizes(placement, len(train_idx), len(val_idx), info)
    check_inputs(data, train_idx, lcfg, share)
    sample_bytes, where = len(train_idx) * data.meta.sample_bytes, device or torch.device("cpu")
    order = agree_order(lcfg, data.reader, sample_bytes, info, where, say, recorded)
    sampler: Any = make_sampler_for(
        data.reader,
        data.meta,
        data.labels,
        train_idx,
        lcfg,
        shuffle=order.shuffle,
        window_bytes=order.window_bytes,
        rank=share.rank,
        world_size=share.world_size,
        say=say,
    )
    if placement.sharded:  # DDP needs as many steps on every rank
        sampler = EqualSteps(sampler, equal_steps(len(sampler), info))
    return RankData(data, placement, train_idx, val_idx, sampler, sizes, records)
