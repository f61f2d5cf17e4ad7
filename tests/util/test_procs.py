"""The start method of worker and reader processes (lmdbstore.util.procs): ``fork`` while no runtime's threads
run (TensorFlow imported but idle: a plain torch script as users write it, without the ``__main__`` guard,
with a lambda transform, even read from stdin), ``forkserver`` once TensorFlow's runtime runs, and then a
missing guard is one line saying so.  Each case runs in a process of its own (TensorFlow must not be loaded
into the test process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, StoreInfo

from lmdbstore.util.procs import start_hint

needs_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed (lmdbstore[frameworks])"
)

#: A guard-less torch training script with TensorFlow imported (what Keras on the torch backend does).
TORCH_WITH_TF = """
import multiprocessing as mp, sys, time
import tensorflow as tf
import lmdbstore
from lmdbstore import EpochBatchSampler, LmdbBatchDataset, LoaderConfig, make_loader
from lmdbstore.util.procs import fork_unsafe, start_method

ds = LmdbBatchDataset(STORE, transform=lambda x, y: (x * 1, y))  # a lambda: fine when forked
loader = make_loader(ds, EpochBatchSampler(range(len(ds)), 100), LoaderConfig(batch_size=100, workers=2))
t = time.monotonic()
batches = iter(loader)
next(batches)
ctx = loader.multiprocessing_context
method = ctx.get_start_method() if ctx is not None else mp.get_start_method()
print("START", time.monotonic() - t, method, fork_unsafe(), flush=True)
print("SAMPLES", 100 + sum(len(y) for _, y in batches), flush=True)
del batches, loader
tf.constant(1.0) + 1  # TensorFlow's runtime starts: forking is unsafe from now on
print("UNSAFE", fork_unsafe(), start_method(None), flush=True)
loader = make_loader(ds, EpochBatchSampler(range(len(ds)), 100), LoaderConfig(batch_size=100, workers=2))
try:
    next(iter(loader))
except (lmdbstore.LmdbStoreError, ValueError) as exc:
    print("REFUSED", exc, flush=True)
"""


def _run(code: str | None, store: Path, tmp_path: Path, *, stdin: bool = False) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text((code or TORCH_WITH_TF).replace("STORE", repr(str(store))))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-"] if stdin else [sys.executable, str(script)]
    return subprocess.run(
        args, input=script.read_text() if stdin else None, capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=300,
    )  # fmt: skip


def _lines(out: str, tag: str) -> list[str]:
    return [ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith(tag + " ")]


@needs_tf
@pytest.mark.parametrize("stdin", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["file", "stdin"])
def test_a_guardless_torch_script_with_tensorflow_imported_forks(
    small_store: StoreInfo, tmp_path: Path, stdin: bool
) -> None:
    proc = _run(None, small_store.path, tmp_path, stdin=stdin)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds, method, unsafe = _lines(proc.stdout, "START")[0].split()
    assert method == "fork" and unsafe == "None"  # imported, not running: no worker imports TensorFlow again
    assert float(seconds) < 20  # a generous sanity bound (was 26.5 s for 8k samples by forkserver)
    assert _lines(proc.stdout, "SAMPLES") == [str(len(small_store.y))]
    assert _lines(proc.stdout, "UNSAFE") == ["TensorFlow's runtime is running forkserver"]
    (refused,) = _lines(proc.stdout, "REFUSED")  # one line each
    if stdin:  # nothing is imported again, so no guard is needed; but the lambda cannot travel
        assert "forkserver" in refused and "module-level function" in refused
    else:
        assert "forkserver" in refused and '`if __name__ == "__main__":`' in refused


GUARD_CASES = {
    "top level": ("check()", True),
    "guarded": ('if __name__ == "__main__":\n    check()', False),
    "function from top level": ("def main():\n    check()\n\nmain()", True),
    "function from the guard": ('def main():\n    check()\n\nif __name__ == "__main__":\n    main()', False),
}


@pytest.mark.parametrize("case", list(GUARD_CASES))
def test_missing_main_guard_is_found_where_the_script_calls_from(tmp_path: Path, case: str) -> None:
    body, missing = GUARD_CASES[case]
    code = "from lmdbstore.util.procs import missing_main_guard\n\ndef check():\n    print(missing_main_guard())\n\n"
    (tmp_path / "s.py").write_text(code + textwrap.dedent(body) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(tmp_path / "s.py")], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == str(missing), out.stderr
    piped = subprocess.run(
        [sys.executable, "-"],
        input=(tmp_path / "s.py").read_text(),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert piped.stdout.strip() == "False", piped.stderr  # from stdin nothing is imported again


def test_the_hint_for_a_dead_worker_names_the_guard_only_where_it_matters() -> None:
    assert "__main__" in start_hint("forkserver") and "__main__" in start_hint("spawn")
    assert "__main__" not in start_hint("fork") and "memory" in start_hint("fork")


#: A script whose top level notes every process that runs it; its guarded part reads one batch through feed
#: readers started by forkserver (or spawn), with a transform of its own or none.
NOTING_SCRIPT = """
import os, sys
with open(MARK, "a") as f:
    f.write(f"{os.getpid()}\\n")


def plus_one(x, y):
    x += 1
    return x, y


if __name__ == "__main__":
    from lmdbstore.config import FeedConfig
    from lmdbstore.feed.opening import open_feed

    method, own = sys.argv[1], sys.argv[2] == "own"
    config = FeedConfig(batch_size=64, workers=2, shuffle="none", multiprocessing_context=method)
    feed = open_feed(STORE, config, transform=plus_one if own else None)
    feed.begin()
    x, y = feed.next()
    print("FIRST", float(x[0, 0, 0, 0]), flush=True)
    print("READERS", *[p.pid for p in feed.pool.procs], flush=True)
    feed.close()
"""


@pytest.mark.parametrize("method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
@pytest.mark.parametrize("own", [False, True], ids=["no transform", "the script's transform"])
def test_readers_run_the_main_script_again_only_for_a_transform_of_its_own(
    small_store: StoreInfo, tmp_path: Path, method: str, own: bool
) -> None:
    """forkserver and spawn children import the main script again (its imports: seconds for Keras and
    TensorFlow, every reader start): feed readers skip it unless their transform is defined there."""
    mark = tmp_path / "ran.txt"
    script = tmp_path / "train.py"
    script.write_text(NOTING_SCRIPT.replace("MARK", repr(str(mark))).replace("STORE", repr(str(small_store.path))))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(script), method, "own" if own else "none"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = {int(v) for v in mark.read_text().split()}
    readers = {int(v) for v in _lines(proc.stdout, "READERS")[0].split()}
    assert len(readers) == 2
    if own:  # the transform is the script's: the readers import it, and it runs there
        assert readers <= ran and _lines(proc.stdout, "FIRST") == ["1.0"]
    else:
        assert not readers & ran and _lines(proc.stdout, "FIRST") == ["0.0"]


def test_what_needs_the_main_script() -> None:
    from lmdbstore.util.procs import needs_main

    assert not needs_main(None) and not needs_main(start_hint) and not needs_main({"a": [1, 2]})
    assert needs_main(lambda x: x)  # cannot be pickled here: left to the start, which says why
