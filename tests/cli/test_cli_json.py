"""``--json`` on every command: stdout is exactly one JSON document (``json.loads`` of all of it works), the
human lines go to stderr, and train's epoch numbers agree between the two; progress bars appear only when
stderr is a terminal, unless ``--progress`` asks for them."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from conftest import REPO, StoreInfo, run_cli, strict_json

TRAIN = ["--epochs", "2", "--batch", "256", "--workers", "0", "--width", "4", "--device", "cpu"]


def _json(*args: object) -> tuple[object, str]:
    r = run_cli(*args, "--json")
    assert r.exit_code == 0, r.output
    return strict_json(r.stdout), r.stderr


def test_every_command_prints_only_json_on_stdout(small_store: StoreInfo, tmp_path: Path) -> None:
    store = small_store.path
    doc, err = _json("synth", tmp_path / "d.npz", "-n", "500")
    assert doc == {"out": str(tmp_path / "d.npz"), "samples": 500, "seed": 0} and "wrote 500" in err  # type: ignore[comparison-overlap]
    doc, err = _json("ingest", tmp_path / "s2", tmp_path / "d.npz")
    assert doc["added"] == doc["total"] == 500 and doc["created"] and "created" in err  # type: ignore[index]
    doc, _ = _json("stats", store)
    assert doc["samples"] == 2000  # type: ignore[index]
    doc, err = _json("verify", store)
    assert doc["ok"] is True and "OK" in err  # type: ignore[index]
    doc, err = _json("export", store, tmp_path / "e.npz")
    assert doc["samples"] == 2000 and doc["samples_per_s"] > 0 and "exported" in err  # type: ignore[index]
    doc, err = _json("copy", store, tmp_path / "copy")
    assert doc["samples"] == 2000 and "copied" in err  # type: ignore[index]
    pytest.importorskip("matplotlib")
    doc, err = _json("show", store, "-o", tmp_path / "s.png", "--per-class", "2", "--dpi", "30")
    assert doc["path"] == str(tmp_path / "s.png") and doc["width"] > 0 and "wrote" in err  # type: ignore[index]


def test_train_eval_and_plot_json_agree_with_their_lines(small_store: StoreInfo, tmp_path: Path) -> None:
    run = tmp_path / "run"
    doc, err = _json("train", small_store.path, *TRAIN, "--out", run)
    assert [m["epoch"] for m in doc["epochs"]] == [1, 2] and doc["final"]["epoch"] == 2  # type: ignore[index]
    assert "epoch 1: train loss" in err and "epoch 2: train loss" in err and "confusion matrix" in err
    assert doc["out_dir"] == str(run) and len(doc["confusion"]) == 5  # type: ignore[index]
    # which model it trained (issue 40): in the plan line and the JSON
    assert doc["model"] == {"factory": "lmdbstore.training.model:build_cnn", "args": {"width": 4}}  # type: ignore[index]
    assert "shuffle random (auto), model the built-in CNN(width=4)" in err
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2]
    doc, err = _json("eval", small_store.path, run / "best.pt", "--workers", "0")
    assert doc["samples"] == 2000 and err == ""  # type: ignore[index]
    if sys.modules.get("matplotlib") is not None or _has("matplotlib"):
        doc, err = _json("plot", run, "-o", tmp_path / "p.png", "--dpi", "30")
        assert doc["path"] == str(tmp_path / "p.png") and "wrote" in err  # type: ignore[index]


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _ingest_stderr(tmp_path: Path, *extra: str, terminal: bool) -> str:
    """stderr of ``python -m lmdbstore ingest --synthetic`` written to a pipe, or to a terminal (a pty)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    cmd = [sys.executable, "-m", "lmdbstore", "ingest", str(tmp_path / f"s{len(extra)}{terminal}"),
           "--synthetic", "30000", *extra]  # fmt: skip
    if not terminal:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300).stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=follower, env=env, cwd=REPO)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


#: What a tqdm bar line shows (percent, then the bar).
BAR = "%|"


def test_progress_bars_only_on_a_terminal_unless_asked(tmp_path: Path) -> None:
    assert BAR not in _ingest_stderr(tmp_path, terminal=False)  # a pipe or a log file: no bar redraws
    assert BAR in _ingest_stderr(tmp_path, "--progress", terminal=False)  # asked for
    assert BAR in _ingest_stderr(tmp_path, terminal=True)  # a terminal: bars by default
    assert BAR not in _ingest_stderr(tmp_path, "--no-progress", terminal=True)


#: A failing call of every command ({m}: a path that does not exist, {f}: a regular file, {t}: a new path).
FAILING = {
    "ingest": ["ingest", "{t}", "{m}.npz"],
    "synth": ["synth", "{t}.npz", "-n", "-5"],
    "stats": ["stats", "{m}"],
    "verify": ["verify", "{m}"],
    "train": ["train", "{m}"],
    "eval": ["eval", "{m}", "{m}.pt"],
    "demo": ["demo", "--dir", "{f}", "-n", "10"],
    "export": ["export", "{m}", "{t}.npz"],
    "copy": ["copy", "{m}", "{t}"],
    "show": ["show", "{m}", "-o", "{t}.png"],
    "plot": ["plot", "{m}", "-o", "{t}.png"],
}


@pytest.mark.parametrize("command", list(FAILING))
def test_an_error_under_json_is_one_json_object_on_stdout(tmp_path: Path, command: str) -> None:
    (tmp_path / "file").write_text("x")
    args = [a.format(m=tmp_path / "missing", f=tmp_path / "file", t=tmp_path / "new") for a in FAILING[command]]
    plain = run_cli(*args)
    r = run_cli(*args, "--json")
    assert r.exit_code == plain.exit_code != 0  # the exit status is unchanged
    assert r.stderr == plain.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    doc = strict_json(r.stdout)
    assert set(doc) == {"error", "path", "hint", "kind", "exit_code"} and doc["exit_code"] == r.exit_code
    assert doc["error"] and doc["error"] in r.stderr
    if doc["path"] is not None:
        assert doc["path"] in r.stderr


def test_a_usage_error_under_json_is_one_json_object_too(tmp_path: Path) -> None:
    from conftest import cli_subprocess

    r = cli_subprocess("stats", tmp_path, "--bogus", "--json")
    assert r.returncode == 2 and "No such option: --bogus" in r.stderr
    doc = strict_json(r.stdout)
    assert doc["error"] == "No such option: --bogus" and doc["kind"] == "NoSuchOption" and doc["exit_code"] == 2
    plain = cli_subprocess("stats", tmp_path, "--bogus")
    assert plain.returncode == 2 and plain.stdout == ""
