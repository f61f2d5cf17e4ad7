"""Where this process stands in a ``torchrun`` launch, read from the variables torchrun sets (no torch
import: the CLI asks before anything heavy is loaded)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Launch", "launch"]


@dataclass(frozen=True)
class Launch:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` as torchrun sets them (0/1/0 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and reports."""
        return self.rank == 0


def launch() -> Launch:
    """This process's place in the launch, from its environment."""
    env = os.environ
    return Launch(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")))
