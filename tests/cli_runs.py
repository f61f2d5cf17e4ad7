"""``lmdbstore ARGS`` run in this process as the console script runs it, several runs to one interpreter's start
(seconds where torch is imported), each run's stdout and stderr redirected at the file descriptors into files of
its own: what C code and child processes (reader workers) print is caught as a subprocess's pipes would catch it.

:func:`cli` runs one command through the console script's ``main()`` (its exit status caught; an exception it lets
out is printed as Python prints it, exit status 1).  Rank scripts under ``torchrun`` call it
(tests/training/test_distributed.py, test_placement.py); tests of commands that could crash a process run it as a script,
``python cli_runs.py PLAN.json``: every ``[name, argv]`` of the plan in turn, ``NAME.out``, ``NAME.err`` and
``NAME.code`` written beside the plan.  A run killed by a signal kills this process, which its caller sees (and
the run without a ``.code`` file is the one that died).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def cli(name: str, argv: list[str], where: Path = Path()) -> int:
    """Run ``lmdbstore ARGV``, its outputs to ``where/NAME.out`` and ``where/NAME.err``; its exit status."""
    from lmdbstore_cli.main import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved, argv0 = (os.dup(1), os.dup(2)), sys.argv
    with open(where / f"{name}.out", "w") as out, open(where / f"{name}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["lmdbstore", *argv]
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sys.argv = argv0
    return code


if __name__ == "__main__":
    plan = Path(sys.argv[1])
    for run_name, run_argv in json.loads(plan.read_text()):
        status = cli(run_name, run_argv, plan.parent)
        (plan.parent / f"{run_name}.code").write_text(str(status))
