"""Worker of the CLI damage fuzz (``test_common.py::test_cli_on_damaged_stores``): for each flip of ``PLAN`` (rows
of ``(offset, xor)`` applied to ``STORE/data.mdb`` from row ``START``), runs the CLI commands of ``COMMANDS`` in
this process (typer's runner) and prints one JSON line per command: exit code, whether it ended in an uncaught
exception (a traceback), and whether stderr was empty or one ``error:`` line.  The byte is restored after each flip;
a crash (signal) of this process is seen by the caller."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from lmdbstore_cli.main import app
from typer.testing import CliRunner

COMMANDS = (
    ("stats", "{store}"),
    ("stats", "{store}", "--sample", "64"),
    ("verify", "{store}", "--no-progress"),
    ("export", "{store}", "{out}/x.npz", "--no-progress", "--force"),
    ("copy", "{store}", "{out}/copy"),
)


def main() -> None:
    store, plan_file, start, out = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    plan = np.load(plan_file)
    runner = CliRunner()
    fd = os.open(store / "data.mdb", os.O_RDWR)
    try:
        for i in range(start, len(plan)):
            off, xor = int(plan[i, 0]), int(plan[i, 1])
            orig = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([orig[0] ^ xor]), off)
            try:
                for cmd in COMMANDS:
                    shutil.rmtree(out / "copy", ignore_errors=True)
                    print(json.dumps({"i": i, "cmd": cmd[0], "start": True}), flush=True)
                    r = runner.invoke(app, [a.format(store=store, out=out) for a in cmd])
                    err = r.stderr.replace("\r", "\n").strip().splitlines()
                    err = [ln for ln in err if ln.strip()]
                    one = not err or (len(err) == 1 and err[0].startswith("error: "))
                    raised = r.exception is not None and not isinstance(r.exception, SystemExit)
                    rec = {"i": i, "cmd": " ".join(cmd[:1] + cmd[2:3]), "code": r.exit_code, "one": one}
                    rec["traceback"] = repr(r.exception)[:300] if raised else ""
                    rec["err"] = err[-1][:200] if err else ""
                    print(json.dumps(rec), flush=True)
            finally:
                os.pwrite(fd, orig, off)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
