#!/usr/bin/env python
"""A TFRecord set in, a store out (issue 35): ``--samples`` z-scored 25x25 float32 samples in ``--shards``
``tf.train.Example`` shards (the sample as raw bytes, the label an int64 id; written by lmdbstore's own writer, or
by TensorFlow with ``--tensorflow``), ingested by ``lmdbstore ingest`` in a child process with TensorFlow made
unimportable (``--hide-tf``, the default: the path of a machine without TensorFlow) or importable; then every
sample and label of the store is compared with the source's.

Usage::

    python scripts/bench/tfrecord.py                      # 150k samples in 16 shards (375 MB), a minute or two
    python scripts/bench/tfrecord.py --tensorflow         # the shards written by TensorFlow's TFRecordWriter
    python scripts/bench/tfrecord.py --quick              # 3k samples in 4 shards: a smoke test

Prints one JSON object (sizes, seconds and samples/s of writing the shards and of the ingest, ``equal``: the
store equals the source) and exits 1 when the store differs.  The files go to a temporary directory under
``--workdir``, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lmdbstore.ingestion.sources.tfrecord_io import encode_example, write_records  # noqa: E402
from lmdbstore.store.reader import StoreReader  # noqa: E402

#: Runs the CLI with ``import tensorflow`` failing, as on a machine without it.
NO_TF = (
    "import sys; sys.modules['tensorflow'] = None; from lmdbstore_cli.main import main; "
    "sys.argv = ['lmdbstore', *sys.argv[1:]]; main()"
)
TF_WRITE = """
import sys, numpy as np, tensorflow as tf
path, x, y = sys.argv[1], np.load(sys.argv[2]), np.load(sys.argv[3])
with tf.io.TFRecordWriter(path) as w:
    for a, b in zip(x, y):
        f = {"x": tf.train.Feature(bytes_list=tf.train.BytesList(value=[a.tobytes()])),
             "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(b)]))}
        w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
"""


def source(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 25, 25), dtype=np.float32), rng.integers(0, 5, n)


def write_shards(root: Path, x: np.ndarray, y: np.ndarray, shards: int, tensorflow: bool) -> None:
    for k, part in enumerate(np.array_split(np.arange(len(x)), shards)):
        path = root / f"data.tfrecord-{k:05d}-of-{shards:05d}"
        if not tensorflow:
            write_records(path, (encode_example({"x": x[i].tobytes(), "y": [int(y[i])]}) for i in part))
            continue
        np.save(root / "px.npy", x[part])
        np.save(root / "py.npy", y[part])
        subprocess.run(
            [sys.executable, "-c", TF_WRITE, str(path), str(root / "px.npy"), str(root / "py.npy")], check=True
        )
        (root / "px.npy").unlink()
        (root / "py.npy").unlink()


def equal(store: Path, x: np.ndarray, y: np.ndarray, chunk: int = 16384) -> bool:
    with StoreReader(store) as r:
        if r.meta.count != len(x) or not np.array_equal(r.labels(), y):
            return False
        return all(
            np.array_equal(r.read_range(a, min(a + chunk, len(x))), x[a : a + chunk]) for a in range(0, len(x), chunk)
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=150_000)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--tensorflow", action="store_true", help="write the shards with TensorFlow")
    ap.add_argument("--show-tf", action="store_true", help="let the ingest import TensorFlow (it does not need to)")
    ap.add_argument("--workers", type=int, default=0, help="ingest --workers")
    ap.add_argument("--quick", action="store_true", help="3,000 samples in 4 shards")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.shards = 3000, 4
    x, y = source(args.samples)
    work = Path(tempfile.mkdtemp(prefix="bench_tfrecord_", dir=args.workdir))
    try:
        (work / "shards").mkdir()
        t0 = time.perf_counter()
        write_shards(work / "shards", x, y, args.shards, args.tensorflow)
        t_write = time.perf_counter() - t0
        cli = [sys.executable, "-m", "lmdbstore"] if args.show_tf else [sys.executable, "-c", NO_TF]
        cmd = [
            *cli,
            "ingest",
            str(work / "store"),
            str(work / "shards"),
            "--dtype",
            "float32",
            "--sample-shape",
            "25,25",
        ]
        cmd += ["--workers", str(args.workers), "--json"]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        t_ingest = time.perf_counter() - t0
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        same = equal(work / "store", x, y)
        shard_bytes = sum(p.stat().st_size for p in (work / "shards").iterdir())
        print(json.dumps({
            "samples": args.samples, "shards": args.shards, "shard_bytes": shard_bytes,
            "written_by": "tensorflow" if args.tensorflow else "lmdbstore", "tensorflow_hidden": not args.show_tf,
            "workers": args.workers, "write_s": round(t_write, 2), "ingest_s": round(t_ingest, 2),
            "ingest_samples_per_s": round(args.samples / t_ingest), "equal": same,
        }, indent=1))  # fmt: skip
        return 0 if same else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
