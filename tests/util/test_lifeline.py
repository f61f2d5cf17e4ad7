"""Processes tied to their owner (lmdbstore.util.lifeline): gone at once when the owner is killed, also when
they were forked from a thread that has ended since (which must not kill them), and never confused with a
process that reuses the owner's pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from lmdbstore.util.lifeline import Lifeline, process_alive, process_start_time

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

OWNER = """
import multiprocessing as mp, os, sys, threading, time
from lmdbstore.util.lifeline import Lifeline

def child(lifeline):
    lifeline.attach()
    time.sleep(600)

def start():
    p = mp.get_context(sys.argv[1]).Process(target=child, args=(Lifeline.here(sys.argv[1]),), daemon=False)
    p.start()
    print(p.pid, flush=True)

if __name__ == "__main__":
    t = threading.Thread(target=start)  # forked from a thread that ends at once
    t.start()
    t.join()
    time.sleep(600)
"""


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_worker_outlives_the_thread_that_forked_it_and_dies_with_its_owner(tmp_path: Path, method: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = tmp_path / "owner.py"  # a file: forkserver children import the target from it
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        time.sleep(0.5)
        assert process_start_time(child) is not None  # the thread ended; the worker lives on
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 3
        while process_start_time(child) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_start_time(child) is None
    finally:
        owner.kill()
        owner.wait()


def test_the_owner_is_known_by_pid_and_start_time() -> None:
    me = Lifeline.here(None)
    assert me.owner == os.getpid() and process_alive(me.owner, me.owner_start)
    assert not process_alive(me.owner, (me.owner_start or 0) + 1)  # a process that reused the pid is not it
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not process_alive(int(done.stdout), None)
    me.attach()  # in the owner itself: nothing to do
