"""cli/main.py: the app, whose ``--help`` lists every command, and the console script's entry point
(:func:`~lmdbstore_cli.main.main`): exit statuses, an error as one line on stderr with no traceback, Click's usage
errors (with ``--json`` also one JSON object on stdout), ``--version``.  Through a real child process where the
console script itself is what is tested; everything else through typer's CliRunner."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import (
    run_cli,
    strict_json,
)


def test_help_explains_commands() -> None:
    r = run_cli("--help")
    assert r.exit_code == 0
    for cmd in ("ingest", "stats", "verify", "train", "eval", "synth", "demo"):
        assert cmd in r.stdout
    r = run_cli("ingest", "--help")
    assert "--allow-nonfinite" in r.stdout and "interrupted" in r.stdout
    assert "--no-allow-nonfinite" not in r.stdout


def test_console_script_as_subprocess(tmp_path: Path) -> None:
    exe = shutil.which("lmdbstore", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "lmdbstore"]
    store = tmp_path / "s"
    p = subprocess.run(
        [*cmd, "ingest", str(store), "--synthetic", "500", "--no-progress"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    p = subprocess.run([*cmd, "stats", str(store), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["samples"] == 500
    p = subprocess.run([*cmd, "stats", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().startswith("error: ") and p.stderr.strip().count("\n") == 0
    p = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("lmdbstore ")


def test_a_usage_error_under_json_is_one_json_object_too(tmp_path: Path) -> None:
    from conftest import cli_subprocess

    r = cli_subprocess("stats", tmp_path, "--bogus", "--json")
    assert r.returncode == 2 and "No such option: --bogus" in r.stderr
    doc = strict_json(r.stdout)
    assert doc["error"] == "No such option: --bogus" and doc["kind"] == "NoSuchOption" and doc["exit_code"] == 2
    plain = cli_subprocess("stats", tmp_path, "--bogus")
    assert plain.returncode == 2 and plain.stdout == ""
