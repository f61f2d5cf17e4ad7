"""The signal handlers of the program around lmdbstore stay the program's (issue 34 #3-5), in child processes
(``signals_child.py``): a bus error of the program's own ends it as it would without lmdbstore (one faulthandler
report, never an endless loop between two handlers), a bus error of the batch's destination is not blamed on the
store, no SIGURG reaches a handler the program installed, and after every read SIGBUS's and SIGURG's dispositions are
exactly what they were -- with faulthandler on and off, the program's own SIGBUS and SIGURG handlers, asyncio's loop
handlers, installed before and after the first read, on every read path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import build_store, make_data

from lmdbstore import WriterConfig
from lmdbstore.store import fileread

CHILD = Path(__file__).resolve().parent / "signals_child.py"
N, SEED = 3000, 11
compiled = pytest.mark.skipif(fileread.COMPILED is None, reason="the compiled reader was not built here")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    x, y = make_data(N, SEED)
    return build_store(tmp_path_factory.mktemp("signals") / "s", x, y, config=WriterConfig(sync=False))


def _child(store: Path, *args: str, compiled: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "READ_ROUTE": "compiled" if compiled else "preadv"}
    env.pop("PYTHONFAULTHANDLER", None)  # the child sets faulthandler up itself
    return subprocess.run(
        [sys.executable, str(CHILD), args[0], str(store), str(N), str(SEED), *args[1:]],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def _report(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", ["compiled", "preadv", "lmdb"])
def test_reads_leave_the_programs_handlers_alone(store: Path, path: str) -> None:
    if path != "preadv" and fileread.COMPILED is None:
        pytest.skip("the compiled reader was not built here")
    report = _report(_child(store, "matrix", path, compiled=path != "preadv"))
    assert report["reads"] == 6 * 2 * 12 * 2 and not report["wrong"]  # every batch its own samples
    assert not report["changed"]  # SIGBUS's and SIGURG's disposition after every read as before it
    assert report["opens"] > 0  # the file was opened for writing again and again meanwhile
    # no SIGURG reached the program's handler (a read lease's did: 96 calls in 1,014 batches, issue 34) nor asyncio's
    assert set(report["urg_calls"].values()) == {0}, report["urg_calls"]


@compiled
@pytest.mark.parametrize("faulthandler", ["off", "before", "after"])
@pytest.mark.parametrize("handler", ["none", "exit"])
def test_a_bus_error_of_the_program_ends_it_as_it_would(store: Path, faulthandler: str, handler: str) -> None:
    """Read, set faulthandler up (before or after the first read), then fault on a map of the program's own while
    the reader's handler is installed on another thread: the process ends exactly as without lmdbstore -- by the
    program's own handler (exit 7), or by SIGBUS after at most one faulthandler report (it used to loop between
    faulthandler's and the copier's handlers: 145,000 reports, 71 MB of stderr in 20 s)."""
    res = _child(store, "fault", faulthandler, handler, timeout=30)
    assert res.stdout == ""
    if handler == "exit":
        assert res.returncode == 7 and res.stderr == ""
    else:
        assert res.returncode == -signal.SIGBUS
        reports = res.stderr.count("Fatal Python error: Bus error")
        assert reports == (0 if faulthandler == "off" else 1) and len(res.stderr) < 20_000


@compiled
def test_a_handler_installed_over_the_readers_during_a_guard(store: Path) -> None:
    """faulthandler enabled while a guard runs on another thread (its handler then chains to the reader's): the
    reader never installs itself over it again (guards answer unprotected, batches are read without the map, exact);
    faulthandler disabled, it guards again and leaves SIGBUS as it found it; a bus error of the program's meanwhile
    ends it once."""
    report = _report(_child(store, "foreign", "read"))
    assert report == {"unprotected": True, "read_ok": True, "guarded": True, "read_ok_after": True, "restored": True}
    res = _child(store, "foreign", "fault", timeout=30)
    assert res.returncode == -signal.SIGBUS and res.stderr.count("Fatal Python error: Bus error") == 1


@compiled
def test_a_fault_of_the_destination_is_not_blamed_on_the_store(store: Path) -> None:
    """``out=`` mapping a file truncated under it: a one-line error about the destination (told by the fault's
    address, or preadv's EFAULT), never "the data file's pages could not be copied -- check the disk" on a healthy
    store."""
    report = _report(_child(store, "dest"))
    assert report["type"] == "LmdbStoreError", report
    assert "destination memory could not be written" in report["message"] and "check the disk" not in report["message"]
