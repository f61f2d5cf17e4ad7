"""What a script a test ran leaves behind: the processes marked by an environment variable that every process it
starts inherits, and files in /dev/shm named with their pids (test_lifecycle.py, test_keras_tf.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

SHM = Path("/dev/shm")
#: Seconds the processes get to go after their owner ended: they go at once (this absorbs a loaded machine),
#: well before torch's own worker watchdog (5 s) would end DataLoader workers.
GONE_WITHIN = 3.0


def marked(mark: str) -> list[int]:
    """Processes whose environment carries ``LMDBSTORE_TEST_MARK=mark``."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if f"LMDBSTORE_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    out.append(int(p))
        except OSError:
            pass
    return out


def shm() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def left_behind(mark: str, seen: set[int], before: set[str]) -> str | None:
    """Once the marked script ended: what it left (processes still there :data:`GONE_WITHIN` seconds later,
    killed here so as not to disturb later tests; files in /dev/shm named with one of ``seen`` -- lmdbstore's
    named segments, torch's, Python's -- or lmdbstore segments that were not there ``before``: on Linux
    lmdbstore never names one), or ``None``."""
    deadline = time.monotonic() + GONE_WITHIN
    left = marked(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked(mark)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    if left:
        return f"{len(left)} processes left {GONE_WITHIN} s after the script ended"
    now = shm()
    mine = {n for n in now if any(str(p) in n.replace("-", "_").split("_") for p in seen)}
    files = sorted(mine | {n for n in now - before if n.startswith("lmdbstore-")})
    return f"files left in /dev/shm: {files}" if files else None
