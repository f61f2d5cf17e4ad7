"""Every code block of README.md and docs/*.md runs as printed (issue 26).

Each fenced block with a language is taken out of the document and run in a workspace of small stores and
files this test makes under the names the documents use (``train.lmdb``, ``demo_out/store``, ``a.lmdb``,
``part1.npz``, ``ROOT/<class>/*.npy``, ``clean_x.npy``...):

* ``python``: written to a script and run by this Python (so ``if __name__ == "__main__":`` and spawned
  workers behave as for a user).  Names a block uses but leaves to the reader (``my_augmenting_generator``,
  ``augment``, a Keras ``model``) get a small definition put before it (:data:`PRELUDE`).
* ``bash``: every command, through the installed CLI (``lmdbstore``, ``torchrun``), each one checked.
* ``json``: parsed.

Sizes are scaled down by the substitutions of :data:`SUBSTITUTIONS` (each must still match its document, so
a changed example fails here rather than going stale).  A block that cannot run here (several GPUs or nodes,
Ray, the test suite itself) is preceded in its document by ``<!-- docs-test: skip (why) -->``; those are
reported as skipped with that reason.  The blocks that train, import Keras/TensorFlow or start a cluster are
marked slow.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, REPO, build_store, make_data

from lmdbstore.ingestion.sources.tfrecord_io import encode_example, write_records

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGS = ("python", "bash", "json")
SKIP = re.compile(r"<!-- docs-test: skip \((.+)\) -->")

#: (document, as printed, as run here): sizes for a 2-core CI machine, paths inside the workspace.
SUBSTITUTIONS = [
    ("README.md", "[5, 17, 123_456]", "[5, 17, 9_456]"),
    ("README.md", "for _ in range(31):", "for _ in range(1):"),
    ("README.md", "--model-arg width=16 --epochs 2", "--model-arg width=4 --epochs 1 --max-steps 2 --batch 512"),
    ("api.md", "[5, 17, 123_456]", "[5, 17, 9_456]"),
    ("README.md", 'split="train", batch_size=4096', 'split="train", batch_size=1024'),
    ("README.md", "--epochs 5", "--epochs 1 --max-steps 2 --batch 512"),
    (
        "README.md",
        "--checkpoint-every 500 --resume",
        "--checkpoint-every 500 --resume --epochs 2 --max-steps 2 --batch 512",
    ),
    ("README.md", "epochs=3)  # validation accuracy", "epochs=1)  # validation accuracy"),
    ("README.md", "/nodes/n1/train.lmdb", "nodes/n1/train.lmdb"),
    (
        "README.md",
        "lmdbstore train a.lmdb b.lmdb c.lmdb",
        "lmdbstore train a.lmdb b.lmdb c.lmdb --epochs 1 --max-steps 2 --batch 512",
    ),
    # the torchrun line: tests/training/test_ddp.py runs `torchrun --nproc-per-node 2 -m lmdbstore train` (gloo)
    ("README.md", "torchrun --nproc-per-node 2 -m lmdbstore train STORE --batch 4096", "true"),
    ("api.md", "TrainConfig(epochs=5)", "TrainConfig(epochs=1, max_steps_per_epoch=2)"),
    ("api.md", 'split="val"), epochs=3)', 'split="val"), epochs=1)'),
    ("api.md", "LoaderConfig(batch_size=4096, workers=8)", "LoaderConfig(batch_size=512, workers=8)"),
    ("api.md", "workers=8", "workers=2"),
    ("api.md", "for epoch in range(10)", "for epoch in range(2)"),
    ("README.md", "workers=8", "workers=2"),
    ("README.md", "for epoch in range(10)", "for epoch in range(2)"),
    ("api.md", '"/nodes/n1/train.lmdb"', '"nodes/n1/train.lmdb"'),
    ("api.md", "N, TASK = 10_000_000, 4096", "N, TASK = 10_000, 4096"),
    ("api.md", "workers=16", "workers=2"),
    ("cluster.md", 'Client("tcp://scheduler:8786")', "Client(LocalCluster(n_workers=2, threads_per_worker=1))"),
    ("cluster.md", "from distributed import Client", "from distributed import Client, LocalCluster"),
    ("cluster.md", "range(2442)", "range(3)"),
    ("cluster.md", "10_000_000", "12_288"),
]

#: Definitions of names a block uses without defining them (the reader's own code).
PRELUDE = {
    "my_augmenting_generator": (
        "def my_augmenting_generator():\n"
        "    import numpy as np\n"
        "    rng = np.random.default_rng(0)\n"
        "    for _ in range(2):\n"
        "        yield rng.standard_normal((100, 25, 25), dtype=np.float32), rng.integers(0, 5, 100)\n"
    ),
    "augment": "def augment(x, y):\n    return x, y\n",
    "model": (  # in the main process only: spawned workers import the script again, and Keras costs seconds
        "if __name__ == '__main__':\n"
        "    import keras\n"
        "    model = keras.Sequential([keras.Input((25, 25, 1)), keras.layers.Flatten(), keras.layers.Dense(5)])\n"
        "    model.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
    ),
}
#: What makes a block slow: training, Keras/TensorFlow, a cluster, DDP.
SLOW = ("keras", "tf_dataset", "train(", "lmdbstore train", "Client(", "torchrun", "write_parallel")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_blocks() -> list[Block]:
    """Every fenced block with a language, with its skip reason (the marker on the line before it)."""
    out = []
    for path in DOCS:
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
            skip = SKIP.search(before)
            out.append(Block(path.name, i + 1, m.group(1), "\n".join(lines[i + 1 : j]) + "\n", skip and skip.group(1)))
            i = j + 1
    return out


def as_run(block: Block) -> str:
    code = block.code
    for doc, old, new in SUBSTITUTIONS:
        if doc == block.doc:
            code = code.replace(old, new)
    return code


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the documents name, small."""
    from lmdbstore.ingestion.pipeline import ingest_synthetic

    ws = tmp_path_factory.mktemp("docs")
    x, y = make_data(10_000, 1)
    build_store(ws / "train.lmdb", x, y)
    ingest_synthetic(ws / "demo_out" / "store", 6000, seed=3)
    for k, name in enumerate(["a", "b", "c"]):
        build_store(ws / f"{name}.lmdb", *make_data(3000, 10 + k))
    build_store(ws / "old.lmdb", *make_data(300, 20))
    for k in (1, 2):
        px, py = make_data(500, 30 + k)
        np.savez(ws / f"part{k}.npz", x=px, y=py)
    for c in CLASSES:
        (ws / "ROOT" / c).mkdir(parents=True)
        np.save(ws / "ROOT" / c / "0.npy", make_data(20, 40)[0])
    cx, cy = make_data(500, 50)
    np.save(ws / "clean_x.npy", cx)
    np.save(ws / "clean_y.npy", cy)
    (ws / "nodes" / "n1").mkdir(parents=True)
    (ws / "examples").mkdir()
    shutil.copy(REPO / "examples" / "my_cnn.py", ws / "examples" / "my_cnn.py")
    tf_x, tf_y = make_data(400, 60)
    (ws / "tfrecords").mkdir()
    write_records(
        ws / "tfrecords" / "part.tfrecord",
        (encode_example({"x": a.tobytes(), "y": [int(b)]}) for a, b in zip(tf_x, tf_y, strict=True)),
    )
    return ws


def left_to_reader(code: str) -> list[str]:
    """The names of :data:`PRELUDE` that ``code`` reads without binding them itself (names in strings and
    comments do not count: a comment mentioning a ``"model"`` key needs no Keras model)."""
    tree = ast.parse(code)
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return [n for n in PRELUDE if n in read and n not in bound]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "TF_CPP_MIN_LOG_LEVEL": "3",
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


def _params() -> list[object]:
    out = []
    for b in doc_blocks():
        if b.skip is not None:
            out.append(pytest.param(b, id=b.id, marks=pytest.mark.skip(reason=f"{b.id}: {b.skip}")))
        elif b.lang == "json":
            out.append(pytest.param(b, id=b.id))
        else:
            slow = any(s in b.code for s in SLOW)
            out.append(pytest.param(b, id=b.id, marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("block", _params())
def test_a_doc_block_runs_as_printed(block: Block, workspace: Path, tmp_path: Path) -> None:
    if block.lang == "json":
        json.loads(block.code)
        return
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws)
    code = as_run(block)
    if block.lang == "python":
        script = ws / "block.py"
        script.write_text("".join(PRELUDE[n] for n in left_to_reader(code)) + code)
        proc = subprocess.run([sys.executable, str(script)], cwd=ws, env=_env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, f"{block.id}:\n{proc.stderr[-3000:]}"
        return
    for cmd in _commands(code):
        proc = subprocess.run(["bash", "-c", cmd], cwd=ws, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{block.id}: {cmd}\n{proc.stderr[-3000:]}"


def test_readme_blocks_define_what_they_use_and_show_the_example_file() -> None:
    """The README runs as printed (issue 35): no name left to the reader, and its "your own model" block is
    examples/my_cnn.py (which the commands after it name)."""
    readme = [b for b in doc_blocks() if b.doc == "README.md" and b.skip is None]
    assert all(left_to_reader(b.code) == [] for b in readme if b.lang == "python")
    example = (REPO / "examples" / "my_cnn.py").read_text()
    assert any(b.lang == "python" and b.code.strip() in example for b in readme)
    text = (REPO / "README.md").read_text()
    assert text.index("source .venv/bin/activate") < text.index("lmdbstore ingest train.lmdb part1.npz")


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    blocks = doc_blocks()
    assert len(blocks) >= 17
    unknown = [b.id for b in blocks if b.lang not in LANGS]
    assert not unknown, f"blocks in a language this test cannot run: {unknown}"
    for doc, old, _ in SUBSTITUTIONS:  # an example that changed must change its substitution too
        assert any(b.doc == doc and old in b.code for b in blocks), f"{doc}: {old!r} is no longer in any block"
    skipped = {b.id: b.skip for b in blocks if b.skip is not None}
    assert all(reason.strip() for reason in skipped.values())
    print("skipped:", json.dumps(skipped, indent=1))
