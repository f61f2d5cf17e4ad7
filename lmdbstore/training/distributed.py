"""Where a training process stands under ``torchrun``: joining the process group (NCCL on CUDA, gloo on
CPU), its rank and world size, its device, and summing metrics over ranks.  Without ``torchrun`` every
function is a no-op for the single process."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmdbstore.util.launch import Launch, launch

__all__ = ["DistInfo", "all_reduce", "device_kind", "init_distributed", "resolve_device"]


@dataclass(frozen=True)
class DistInfo(Launch):
    """Where this process stands in the process group: rank, world size, local rank (0/1/0 without
    torchrun), as :class:`~lmdbstore.util.launch.Launch` reads them, once the group is joined."""

    @property
    def active(self) -> bool:
        """More than one process: reductions and DistributedDataParallel are needed."""
        return self.world_size > 1


def device_kind(spec: str) -> str:
    """``"cuda"`` or ``"cpu"``: the kind of device ``spec`` (as :func:`resolve_device` takes it) ends up on,
    known before the process group is joined (it picks NCCL or gloo)."""
    return "cuda" if (spec == "auto" and torch.cuda.is_available()) or spec.startswith("cuda") else "cpu"


def init_distributed(kind: str) -> DistInfo:
    """Join the process group torchrun describes in the environment: NCCL for ``kind`` ``"cuda"``, gloo
    otherwise (no-op for a single process)."""
    env = launch()
    if env.world_size <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if kind == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), env.local_rank)


def all_reduce(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum ``t`` over all ranks in place (nothing to do for a single process)."""
    if info.active:
        dist.all_reduce(t)
    return t


def resolve_device(spec: str, info: DistInfo) -> torch.device:
    """``"auto"``: CUDA (this rank's GPU) when available, else CPU; otherwise ``cpu``, ``cuda`` (this rank's GPU)
    or ``cuda:N``, checked against the machine (``ValueError`` naming what does not parse or exist)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r} (lmdbstore trains on CPU or CUDA)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} asked for, but CUDA is not available")
        count = torch.cuda.device_count()
        if dev.index is None:
            dev = torch.device("cuda", info.local_rank % count)
        elif dev.index >= count:
            raise ValueError(f"device {spec!r} asked for, but this machine has {count} CUDA device(s)")
        torch.cuda.set_device(dev)
    return dev
