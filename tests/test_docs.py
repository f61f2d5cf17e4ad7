"""Every code block of README.md and docs/*.md runs as printed (issues 26, 40).

The README runs top to bottom in one fresh directory (:func:`test_the_readme_runs_top_to_bottom_in_one_directory`),
each block on what the blocks before it made, as a user of the clone's ``.venv`` would run it.  The blocks of
docs/*.md run each in a copy of a workspace of small stores and files under the names they use (``train.lmdb``,
``a.lmdb``, ``part1.npz``, ``ROOT/<class>/*.npy``...).  ``python`` blocks run as scripts of their own (their
``__main__`` guards, spawned workers and Keras as for a user), ``bash`` commands of the CLI in this process
(``typer``'s runner: a subprocess would prove nothing more), other commands through ``bash``; ``json`` blocks are
parsed.

Sizes are scaled down by the substitutions of :data:`SUBSTITUTIONS` (each must still match its document, so a
changed example fails here rather than going stale).  A block that cannot run here (several GPUs or nodes, Ray,
the test suite itself) is preceded in its document by ``<!-- docs-test: skip (why) -->``; a block whose paths
stand for the user's own data by ``<!-- docs-test: template (why) -->``: it runs after :func:`user_data` made
small ones.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, build_store, make_data, run_cli
from tfrecord_writer import encode_example, write_records

LANGS = ("python", "bash", "json")

#: (document, as printed, as run here): sizes for a 2-core CI machine, paths inside the workspace.
SUBSTITUTIONS = [
    ("README.md", "bash scripts/demo.sh", "lmdbstore ingest demo_out/store --synthetic 2048 --seed 3"),  # its store
    ("README.md", "pip install -e '.[viz,tfrecord,keras]'", "true"),  # the test's venv has them
    ("README.md", "-n 20000", "-n 2000"),
    ("README.md", "--synthetic 20000", "--synthetic 2000"),
    ("README.md", "[5, 17, 123_456]", "[5, 17, 9_456]"),
    ("README.md", "for _ in range(31):", "for _ in range(3):"),
    ("README.md", "--model-arg width=16 --epochs 2", "--model-arg width=4 --epochs 1 --max-steps 2 --batch 512"),
    ("README.md", 'split="train", batch_size=4096', 'split="train", batch_size=256'),
    ("README.md", "ROOT/ --workers 4", "ROOT/ --workers 0"),
    ("README.md", "--epochs 5", "--epochs 1 --max-steps 2 --batch 512"),
    (
        "README.md",
        "--checkpoint-every 500 --resume",
        "--checkpoint-every 500 --resume --epochs 2 --max-steps 2 --batch 512",
    ),
    ("README.md", "--out runs/set", "--out runs/set --epochs 1 --max-steps 2 --batch 512"),
    ("README.md", "epochs=3)  # validation accuracy", "epochs=1)  # validation accuracy"),
    # the torchrun line: tests/training/test_ddp.py runs `torchrun --nproc-per-node 2 -m lmdbstore train` (gloo)
    ("README.md", "torchrun --nproc-per-node 2 -m lmdbstore train STORE --batch 4096", "true"),
    ("README.md", "workers=8", "workers=2"),
    ("README.md", "for epoch in range(10)", "for epoch in range(2)"),
    ("api.md", "[5, 17, 123_456]", "[5, 17, 9_456]"),
    ("api.md", "for _ in range(31):", "for _ in range(1):"),
    ("api.md", "TrainConfig(epochs=5)", "TrainConfig(epochs=1, max_steps_per_epoch=2)"),
    ("api.md", 'split="val"), epochs=3)', 'split="val"), epochs=1)'),
    ("api.md", "LoaderConfig(batch_size=4096, workers=8)", "LoaderConfig(batch_size=512, workers=8)"),
    ("api.md", "workers=8", "workers=2"),
    ("api.md", "for epoch in range(10)", "for epoch in range(2)"),
    ("api.md", '"/nodes/n1/train.lmdb"', '"nodes/n1/train.lmdb"'),
    ("api.md", "N, TASK = 10_000_000, 4096", "N, TASK = 10_000, 4096"),
    ("api.md", "workers=16", "workers=2"),
    ("api.md", 'old.lmdb"]), workers=2)', 'old.lmdb"]), workers=0)'),  # spawned ingest workers: tests/ingestion
    ("cluster.md", 'Client("tcp://scheduler:8786")', "Client(LocalCluster(n_workers=2, threads_per_worker=1))"),
    ("cluster.md", "from distributed import Client", "from distributed import Client, LocalCluster"),
    ("cluster.md", "range(2442)", "range(3)"),
    ("cluster.md", "10_000_000", "12_288"),
]

#: What makes a docs/*.md block slow: training, Keras/TensorFlow, a cluster, DDP.
SLOW = ("keras", "tf_dataset", "train(", "lmdbstore train", "Client(", "torchrun", "write_parallel")
MARKER = re.compile(r"<!-- docs-test: (skip|template) \((.+)\) -->")
README = REPO / "README.md"


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    code: str
    marker: str | None  # "skip" or "template"
    why: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_blocks(paths: list[Path]) -> list[Block]:
    """Every fenced block with a language, with its marker (on the line before it), in document order."""
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\w+)\s*$", lines[i])
            if not m:
                i += 1
                continue
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            mark = MARKER.search(before)
            code = "\n".join(lines[i + 1 : j]) + "\n"
            out.append(Block(path.name, i + 1, m.group(1), code, mark and mark.group(1), mark and mark.group(2)))
            i = j + 1
    return out


def as_run(block: Block) -> str:
    code = block.code
    for doc, old, new in SUBSTITUTIONS:
        if doc == block.doc:
            code = code.replace(old, new)
    return code


def user_data(ws: Path) -> None:
    """What a template block stands for: a small class tree ``ROOT/`` (of the store's classes) and ``tfrecords/``."""
    from lmdbstore.ingestion.synth import SYNTH_CLASSES

    for k, c in enumerate(SYNTH_CLASSES):
        (ws / "ROOT" / c).mkdir(parents=True, exist_ok=True)
        np.save(ws / "ROOT" / c / "0.npy", make_data(20, 40 + k)[0])
    tf_x, tf_y = make_data(400, 60)
    (ws / "tfrecords").mkdir(exist_ok=True)
    write_records(
        ws / "tfrecords" / "part.tfrecord",
        (encode_example({"x": a.tobytes(), "y": [int(b)]}) for a, b in zip(tf_x, tf_y, strict=True)),
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files docs/*.md name, small."""
    ws = tmp_path_factory.mktemp("docs")
    build_store(ws / "train.lmdb", *make_data(10_000, 1))
    build_store(ws / "old.lmdb", *make_data(300, 20))
    px, py = make_data(500, 31)
    np.savez(ws / "part1.npz", x=px, y=py)
    cx, cy = make_data(500, 50)
    np.save(ws / "clean_x.npy", cx)
    np.save(ws / "clean_y.npy", cy)
    (ws / "nodes" / "n1").mkdir(parents=True)
    return ws


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "KERAS_BACKEND": "torch",  # as in the demo's .venv; Keras on TensorFlow is tests/frameworks' to check
    }


def _commands(code: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    joined = code.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        cmd = re.split(r"\s#\s|^#", line)[0].strip()
        if cmd:
            out.append(cmd)
    return out


def run_block(block: Block, ws: Path) -> None:
    """Run one block in ``ws``, the current directory (see this module's docstring)."""
    code = as_run(block)
    if block.lang == "json":
        json.loads(code)
        return
    if block.lang == "python":
        script = ws / "block.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], cwd=ws, env=_env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, f"{block.id}:\n{proc.stderr[-3000:]}"
        return
    for cmd in _commands(code):
        if cmd.startswith("lmdbstore ") and not re.search(r"[|&;<>$`*?]", cmd):
            res = run_cli(*shlex.split(cmd)[1:])
            assert res.exit_code == 0, f"{block.id}: {cmd}\n{res.stderr[-3000:]}"
            continue
        proc = subprocess.run(["bash", "-c", cmd], cwd=ws, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{block.id}: {cmd}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_the_readme_runs_top_to_bottom_in_one_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40: the README's blocks, in order, in one fresh directory holding only the clone's example file,
    each on what the blocks before it made (the Python tour writes a store of its own: the command tour's
    ``train.lmdb`` has other classes)."""
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "my_cnn.py", tmp_path / "examples" / "my_cnn.py")
    monkeypatch.chdir(tmp_path)
    ran = []
    for block in doc_blocks([README]):
        if block.marker == "skip":
            continue
        if block.marker == "template":
            user_data(tmp_path)
        run_block(block, tmp_path)
        ran.append(block.id)
    assert len(ran) >= 6, ran


def _params() -> list[object]:
    out: list[object] = []
    for b in doc_blocks(sorted((REPO / "docs").glob("*.md"))):
        if b.marker == "skip":
            out.append(pytest.param(b, id=b.id, marks=pytest.mark.skip(reason=f"{b.id}: {b.why}")))
        else:
            slow = b.lang != "json" and any(s in b.code for s in SLOW)
            out.append(pytest.param(b, id=b.id, marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("block", _params())
def test_a_doc_block_runs_as_printed(
    block: Block, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    monkeypatch.chdir(ws)
    run_block(block, ws)


def test_readme_shows_the_example_file_and_how_to_reach_the_commands() -> None:
    """The README's "your own model" block is examples/my_cnn.py (which the commands after it name), and the
    commands are found: the venv is activated before the tour."""
    example = (REPO / "examples" / "my_cnn.py").read_text()
    assert any(b.lang == "python" and b.code.strip() in example for b in doc_blocks([README]))
    text = README.read_text()
    assert text.index("source .venv/bin/activate") < text.index("lmdbstore ingest train.lmdb part1.npz")


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    blocks = doc_blocks([README, *sorted((REPO / "docs").glob("*.md"))])
    assert len(blocks) >= 17
    unknown = [b.id for b in blocks if b.lang not in LANGS]
    assert not unknown, f"blocks in a language this test cannot run: {unknown}"
    for doc, old, _ in SUBSTITUTIONS:  # an example that changed must change its substitution too
        assert any(b.doc == doc and old in b.code for b in blocks), f"{doc}: {old!r} is no longer in any block"
    assert all(b.why and b.why.strip() for b in blocks if b.marker is not None)
    print("marked:", json.dumps({b.id: f"{b.marker}: {b.why}" for b in blocks if b.marker is not None}, indent=1))
