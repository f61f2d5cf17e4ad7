"""Shared test helpers and fixtures for the lmdbstore test suite.

Everything here builds *real* stores with the real writer in pytest's ``tmp_path``; nothing is mocked.
Fixture and helper names are stable: other test files rely on them.

Module-level helpers (importable with ``from conftest import make_data, build_store, ...``):

``CLASSES``
    ``["a", "b", "c", "d", "e"]``, the class names every fixture store uses.
``make_data(n, seed=0, *, shape=(25, 25), dtype=np.float32, n_classes=5, p=None)``
    Deterministic ``(x, y)``: ``x`` of shape ``(n, *shape)`` and ``dtype``, ``y`` int64 in
    ``0..n_classes-1`` (drawn with probabilities ``p``, uniform by default).  Float samples are standard
    normal, integer samples uniform over the dtype's range.  **The first element of every sample encodes
    its index** (``x[i].flat[0] == i``; modulo the range for small integer dtypes, exact in float16
    only below 2,048), so a test can
    tell exactly which samples came back from a loader.
``build_store(path, x, y, *, classes=CLASSES, config=None, batch=None)``
    Write ``(x, y)`` into a new store at ``path`` with :func:`lmdbstore.open_writer` (in batches of
    ``batch`` samples, each committed, when given) and return ``path``.
``snapshot_store(path)``
    Every key and value of every sub-database, read through raw py-lmdb, as a dict: compare two
    snapshots to prove an operation left a store byte-for-byte unchanged.
``run_cli_measured(tmp_path, *args, limit_mib=4096)``
    Run the CLI as a child process (address space capped at ``limit_mib``) and return a :class:`CliRun`
    with its exit status, stdout, stderr and peak resident memory in MiB (``peak_mib``).
``raw_env(path)``
    Context manager yielding a raw, writable ``lmdb.Environment`` on the store (closed on exit), for
    tests that damage a store on purpose.  No :class:`StoreReader` of that store may be open in the
    process meanwhile (py-lmdb refuses to open one environment twice in a process).
``HALF_CREATED`` and ``half_created(path, state)``
    Build, for real, what a store creation killed before its first commit leaves at ``path`` (a new
    directory) and return ``path``: ``"lock_only"`` (just ``writer.lock``), ``"empty_env"`` (plus an LMDB
    environment opened and closed without any write transaction: ``data.mdb`` with two empty meta pages,
    ``lock.mdb``) or ``"empty_data"`` (``data.mdb`` of 0 bytes, ``lock.mdb``, ``writer.lock``).
``DAMAGES`` and ``damage_store(path, how)``
    Damage the store at ``path`` in place: ``"truncate"`` (``data.mdb`` cut to half its size),
    ``"garble_leaf"`` (seeded random bytes over the nodes of the ``samples`` B-tree's first leaf page) or
    ``"zero_leaf"`` (that whole page zeroed).  No reader of the store may be open in the process.
``cli_subprocess(*args, timeout=300)``
    Run ``python -m lmdbstore ARGS`` (this checkout's code) and return the ``CompletedProcess``.
``SET_PARTS``, ``SET_CLASSES``, ``build_set(base, parts=SET_PARTS, seed=0) -> SetInfo``
    A set of stores under ``base`` (``s0``, ``s1``, ...), one per ``(n, classes)`` part: by default three stores
    of 1,000, 517 and 263 samples (off the 18-sample packing) whose class lists are reordered, add a class
    ("x") and leave some out; ``SET_CLASSES`` is the set's class list.  ``x[i].flat[0]`` is ``i``'s index in
    the set; ``SetInfo`` has ``paths``, ``x`` (all samples, in set order) and ``names`` (each one's class name).
``dir_bytes(path)``
    ``{name: bytes}`` of every file in the directory ``path``: compare two to prove it was left untouched.
``write_h5(path, n=400, names="attr")``
    An HDF5 file of ``make_data(n, 9)`` (``x``, ``y`` in 0..2) with the class names "cat", "dog", "eel" where
    ``names`` says (a file attribute, a ``classes`` dataset, an attribute of ``y``, or none); needs h5py
    (``needs_h5py`` marks a test that does).

Fixtures:

``make_data``
    The :func:`make_data` function itself.
``store_factory``
    ``store_factory(n=2000, seed=0, *, name="store", shape=(25, 25), dtype=np.float32, config=None,
    batch=None, p=None) -> StoreInfo``: a new store in ``tmp_path`` holding ``make_data(n, seed, ...)``.
``small_store``
    A :class:`StoreInfo` for 2,000 z-scored-like 25x25 float32 samples with classes "a".."e"
    (default writer config: 18 samples per value, crc32 trailer; the last value is partial).
``synth``
    A store (``Path``) of 2,000 samples of the learnable synthetic set (``ingest_synthetic``, seed 5).
``three``
    The :func:`build_set` of :data:`SET_PARTS` (a ``SetInfo``), built once per test module.

``StoreInfo`` has fields ``path`` (``pathlib.Path`` of the store), ``x`` and ``y`` (the arrays written).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

#: One compute thread per process: the suite runs one pytest-xdist worker per core (scripts/test.sh), and every
#: worker and every process a test starts (CLI runs, training scripts, framework checks) inherits these.  With
#: torch's, TensorFlow's and XLA's default of one thread per core, two workers on two cores oversubscribe them,
#: and their spinning threads doubled the CPU time of the training tests.  Set before torch is imported;
#: a value already in the environment wins.
SINGLE_THREADED = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
}
for _name, _value in SINGLE_THREADED.items():
    os.environ.setdefault(_name, _value)

from lmdbstore import WriterConfig, open_writer  # noqa: E402 (after the thread settings)
from lmdbstore.format.layout import ALL_DBS, DB_META, DB_SAMPLES, MAX_DBS  # noqa: E402

#: The tests folder (``parallel_tasks.py`` lives here) and the repository root.
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

CLASSES = ["a", "b", "c", "d", "e"]


@dataclass(frozen=True)
class StoreInfo:
    """A store built for a test and the data written into it."""

    path: Path
    x: np.ndarray
    y: np.ndarray


def make_data(
    n: int,
    seed: int = 0,
    *,
    shape: Sequence[int] = (25, 25),
    dtype: Any = np.float32,
    n_classes: int = 5,
    p: Sequence[float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic samples and labels; ``x[i].flat[0]`` encodes ``i`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    full = (n, *shape)
    if dt.kind == "f":
        x = rng.standard_normal(full).astype(dt)
    else:
        info = np.iinfo(dt)
        x = rng.integers(info.min, info.max, size=full, dtype=dt, endpoint=True)
    if n:
        flat = x.reshape(n, -1)
        if dt.kind == "f":
            flat[:, 0] = np.arange(n)
        else:
            modulus = min(int(np.iinfo(dt).max) + 1, 1 << 62)
            flat[:, 0] = (np.arange(n) % modulus).astype(dt)
    y = rng.choice(n_classes, size=n, p=p).astype(np.int64)
    return x, y


def build_store(
    path: Path,
    x: np.ndarray,
    y: np.ndarray,
    *,
    classes: Sequence[str] = CLASSES,
    config: WriterConfig | None = None,
    batch: int | None = None,
) -> Path:
    """Write ``(x, y)`` to a new store at ``path`` (committing every ``batch`` samples if given)."""
    with open_writer(path, shape=x.shape[1:], dtype=x.dtype, classes=classes, config=config) as w:
        step = batch or max(len(x), 1)
        for lo in range(0, len(x), step):
            w.append(x[lo : lo + step], y[lo : lo + step])
            if batch:
                w.commit()
    return path


@contextmanager
def raw_env(path: Path, *, readonly: bool = False) -> Iterator[lmdb.Environment]:
    """A raw py-lmdb environment on the store directory, closed on exit."""
    env = lmdb.open(str(path), max_dbs=MAX_DBS, readonly=readonly, create=False, lock=not readonly)
    try:
        yield env
    finally:
        env.close()


def snapshot_store(path: Path) -> dict[bytes, dict[bytes, bytes]]:
    """Every (key, value) of every sub-database of the store at ``path``."""
    out: dict[bytes, dict[bytes, bytes]] = {}
    with raw_env(path, readonly=True) as env, env.begin() as txn:
        for name in ALL_DBS:
            db = env.open_db(name, txn=txn, create=False)
            out[name] = {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
    return out


HALF_CREATED = ("lock_only", "empty_env", "empty_data")


def half_created(path: Path, state: str) -> Path:
    """What a store creation killed before its first commit leaves (see the module docstring)."""
    assert state in HALF_CREATED, state
    path.mkdir(parents=True)
    (path / "writer.lock").touch()
    if state != "lock_only":
        lmdb.open(str(path), max_dbs=MAX_DBS).close()  # LMDB creates data.mdb and lock.mdb; nothing committed
    if state == "empty_data":
        os.truncate(path / "data.mdb", 0)  # killed between LMDB creating data.mdb and writing its meta pages
    return path


DAMAGES = ("truncate", "garble_leaf", "zero_leaf")


def _samples_leaf_page(path: Path) -> tuple[int, int]:
    """(page number, page size) of the first leaf page of the ``samples`` B-tree."""
    from lmdbstore.format.btree import main_db_entry
    from lmdbstore.format.pages import P_BRANCH, PageReader, read_meta_page

    fd = os.open(path / "data.mdb", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        meta = max((read_meta_page(fd, size, i) for i in (0, 1)), key=lambda m: m.txnid)
        pages = PageReader(fd, size, meta, path, None)
        db = main_db_entry(pages, meta.main, DB_SAMPLES)
        pgno = db.root
        for _ in range(db.depth - 1):  # leftmost child, level by level
            page = pages.read([pgno], P_BRANCH)[0]
            ptr, words = pages.nodes(page, pgno)
            w = int(ptr[0]) // 2
            pgno = int(words[w]) | int(words[w + 1]) << 16 | int(words[w + 2]) << 32
        return pgno, meta.psize
    finally:
        os.close(fd)


def damage_store(path: Path, how: str) -> Path:
    """Damage the store at ``path`` in place (see the module docstring); returns ``path``."""
    assert how in DAMAGES, how
    data = path / "data.mdb"
    if how == "truncate":
        os.truncate(data, data.stat().st_size // 2)
        return path
    pgno, psize = _samples_leaf_page(path)
    with open(data, "r+b") as f:
        if how == "zero_leaf":
            f.seek(pgno * psize)
            f.write(bytes(psize))
        else:  # the node area sits at the end of the page, above ``upper``
            f.seek(pgno * psize + psize // 2)
            f.write(np.random.default_rng(5).integers(0, 256, psize // 2, dtype=np.uint8).tobytes())
    return path


def cli_subprocess(*args: str | Path, timeout: float = 300) -> Any:
    """Run the CLI of this checkout as ``python -m lmdbstore ARGS``; returns the ``CompletedProcess``."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "lmdbstore", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
        env=env,
    )


def dir_bytes(path: Path) -> dict[str, bytes]:
    """Every file of the directory ``path``, by name."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def default_sigint() -> None:
    """``preexec_fn`` of a script a test interrupts: Ctrl-C's default disposition before Python starts.  A shell
    runs background jobs with SIGINT ignored (``pytest ... &``, some CI runners), an ignored signal stays
    ignored across exec, and Python then installs no KeyboardInterrupt handler: the script would never hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the test files that hold a ``slow`` test first, each file's tests together and in order.

    pytest-xdist (scripts/test.sh: ``--dist loadscope --no-loadscope-reorder``) hands whole test files to its
    workers in this order, so the long files start early and the workers end together on short ones rather than
    one waiting for the other's last long file; a file goes to one worker, so its module-scoped fixtures are
    built once.  The order is a pure function of the collected tests: every worker must collect the same list.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group stays


@pytest.fixture(name="make_data")
def make_data_fixture() -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    """The :func:`make_data` factory."""
    return make_data


@pytest.fixture
def store_factory(tmp_path: Path) -> Callable[..., StoreInfo]:
    """Build stores of :func:`make_data` samples in ``tmp_path`` (see the module docstring)."""

    def factory(
        n: int = 2000,
        seed: int = 0,
        *,
        name: str = "store",
        shape: Sequence[int] = (25, 25),
        dtype: Any = np.float32,
        config: WriterConfig | None = None,
        batch: int | None = None,
        p: Sequence[float] | None = None,
    ) -> StoreInfo:
        x, y = make_data(n, seed, shape=shape, dtype=dtype, p=p)
        path = build_store(tmp_path / name, x, y, config=config, batch=batch)
        return StoreInfo(path, x, y)

    return factory


@pytest.fixture
def small_store(store_factory: Callable[..., StoreInfo]) -> StoreInfo:
    """2,000 25x25 float32 samples, classes "a".."e", default writer settings."""
    return store_factory(2000, seed=1234)


@pytest.fixture
def synth(tmp_path: Path) -> Path:
    """A store of 2,000 samples of the learnable synthetic set (``ingest --synthetic 2000``, seed 5)."""
    from lmdbstore.ingestion.pipeline import ingest_synthetic

    ingest_synthetic(tmp_path / "synth", 2000, seed=5)
    return tmp_path / "synth"


def run_cli(*args: str | Path) -> Any:
    """Invoke the ``lmdbstore`` CLI in this process (typer's CliRunner); returns its ``Result``."""
    from lmdbstore_cli.main import app
    from typer.testing import CliRunner

    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(result: Any) -> str:
    """The CLI's error output: exactly one line, starting ``error: ``."""
    text = result.stderr.strip()
    assert text.count("\n") == 0, text
    assert text.startswith("error: ")
    return text


@dataclass(frozen=True)
class CliRun:
    """A CLI run in a subprocess: exit status, outputs and the child's peak resident memory."""

    returncode: int
    stdout: str
    stderr: str
    peak_mib: float


#: Runs the CLI in a child and, at its exit, writes the child's own peak RSS (``VmHWM``, KiB) to a file.
#: Not ``ru_maxrss`` from ``wait4``: a forked child starts with its parent's high-water mark (pytest's).
_MEASURED_CLI = """
import atexit, os, sys

def _peak():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(os.environ["LMDBSTORE_TEST_PEAK"], "w") as out:
        out.write(kib)

atexit.register(_peak)
sys.argv[0] = "lmdbstore"
from lmdbstore_cli.main import main
main()
"""


def run_cli_measured(tmp_path: Path, *args: str | Path, limit_mib: int = 4096, timeout: float = 300) -> CliRun:
    """Run the CLI (``lmdbstore_cli.main``) with ``args`` as a child process and measure its own peak RSS (``VmHWM``).

    The child's address space is capped at ``limit_mib`` (``RLIMIT_AS``), so a run that would allocate without
    bound fails fast instead of exhausting the machine.  Outputs go to files in ``tmp_path``: a runaway error
    message cannot fill a pipe and hang the test.
    """
    import os
    import resource
    import subprocess
    import sys

    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to measure peak memory")
    repo = Path(__file__).resolve().parents[1]
    peak_file = tmp_path / "cli.peak"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", LMDBSTORE_TEST_PEAK=str(peak_file))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_mib << 20, limit_mib << 20))

    out_path, err_path = tmp_path / "cli.stdout", tmp_path / "cli.stderr"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        p = subprocess.run(
            [sys.executable, "-c", _MEASURED_CLI, *map(str, args)],
            stdout=out,
            stderr=err,
            env=env,
            cwd=repo,
            preexec_fn=limit,
            timeout=timeout,
            check=False,
        )

    def read(f: Path) -> str:
        return f.read_bytes()[:100_000].decode(errors="replace")

    peak = int(peak_file.read_text()) / 1024 if peak_file.exists() else float("inf")
    return CliRun(p.returncode, read(out_path), read(err_path), peak)


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses ``NaN``/``Infinity`` (not JSON, though Python's json writes them)."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"invalid JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def edit_meta_text(path: Path, edit: Callable[[str], str]) -> None:
    """Rewrite the raw JSON text of the store's metadata record with ``edit`` (to tamper with it)."""
    with raw_env(path) as env, env.begin(write=True) as txn:
        db = env.open_db(DB_META, txn=txn, create=False)
        raw = bytes(txn.get(b"meta", db=db)).decode()
        txn.put(b"meta", edit(raw).encode(), db=db)


# ---------------------------------------------------------------------------------------------- ingest sources
# Shared by tests/ingestion/test_sources_*.py (one file per source module).
from lmdbstore.ingestion.sources import Source  # noqa: E402 - this block's own import

try:
    import h5py
except ImportError:  # pragma: no cover - h5py is a dev dependency
    h5py = None
#: Marks a test that needs the optional h5py (``lmdbstore[hdf5]``).
needs_h5py = pytest.mark.skipif(h5py is None, reason="h5py (lmdbstore[hdf5]) is not installed")


def write_h5(path: Path, n: int = 400, names: str | None = "attr") -> Path:
    """An HDF5 file of ``make_data(n, 9)``: datasets ``x`` and ``y`` (labels 0..2), the class names "cat", "dog",
    "eel" in a file attribute (``names="attr"``), a ``classes`` dataset (``"dataset"``), an attribute of ``y``
    (``"y_attr"``) or nowhere (``None``)."""
    x, y = make_data(n, 9)
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y % 3
        if names == "attr":
            f.attrs["class_names"] = ["cat", "dog", "eel"]
        elif names == "dataset":
            f["classes"] = np.array([b"cat", b"dog", b"eel"])
        elif names == "y_attr":
            f["y"].attrs["class_names"] = np.array(["cat", "dog", "eel"], dtype=h5py.string_dtype())
    return path


#: Per-sample shape and sample count of the arrays the source tests write (:func:`make_x`).
SOURCE_SHAPE = (4, 3)
SOURCE_N = 157
#: Batch sizes :func:`assert_roundtrip` reads with.
SOURCE_BATCHES = [1, 7, 64, 1000]


def make_x(n: int = SOURCE_N, shape: tuple[int, ...] = SOURCE_SHAPE, dtype: Any = "f4", seed: int = 0) -> np.ndarray:
    """Deterministic samples: standard normal for float ``dtype``, integers 0..99 otherwise."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal((n, *shape)).astype(dtype)
    return rng.integers(0, 100, (n, *shape)).astype(dtype)


def collect(src: Source, batch: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """All (x, y) from ``start``, checking the batch contract on the way."""
    xs, ys = [], []
    for x, y in src.iter_batches(batch, start):
        assert x.dtype == src.dtype and x.shape[1:] == src.shape
        assert 1 <= len(x) <= batch and len(y) == len(x) and y.ndim == 1
        assert x.flags.c_contiguous and x.flags.writeable
        xs.append(x)
        ys.append(y)
    if not xs:
        return np.zeros((0, *src.shape), src.dtype), np.zeros(0)
    return np.concatenate(xs).astype(src.dtype), np.concatenate(ys)  # concatenate drops byte order


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Same shape, dtype and bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_roundtrip(src: Source, x: np.ndarray, y: np.ndarray) -> None:
    """Every batch size and several start offsets give exactly x[start:], y[start:]."""
    assert len(src) == len(x)
    for batch in SOURCE_BATCHES:
        for start in (0, 5, len(x) - 1, len(x)):
            got_x, got_y = collect(src, batch, start)
            assert same_bits(got_x, x[start:]), (batch, start)
            assert got_y.tolist() == y[start:].tolist(), (batch, start)


def one_line(err: pytest.ExceptionInfo[Any], *names: str | Path) -> str:
    """The raised error's text, checked to be one line naming every one of ``names``."""
    text = str(err.value)
    assert "\n" not in text
    for name in names:
        assert str(name) in text, (name, text)
    return text


def write_dir(root: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """b_dog: 3 stacks (one of them a single-row stack); a_cat: 20 single-sample files; c_eel: empty."""
    (root / "b_dog").mkdir(parents=True)
    (root / "a_cat").mkdir()
    (root / "c_eel").mkdir()  # a class with no files: still a class name, no source
    (root / ".hidden").mkdir()
    np.save(root / "b_dog" / "s2.npy", x[20:50])
    np.save(root / "b_dog" / "s1.npy", x[50:51])  # stack of one: shape (1, *SHAPE)
    np.save(root / "b_dog" / "s0.npy", x[51:90])
    (root / "b_dog" / "notes.txt").write_text("ignored")
    for i in range(20):
        np.save(root / "a_cat" / f"{i:03d}.npy", x[i])
    # files sorted by name: b_dog is s0, s1, s2
    return {"a_cat": x[:20], "b_dog": np.concatenate([x[51:90], x[50:51], x[20:50]])}


def truncate_file(path: Path, keep: float) -> None:
    """Cut the file at ``path`` to the fraction ``keep`` of its bytes."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


#: Three stores: sizes off the 18-sample packing, classes reordered, one class ("x") only in the second,
#: "c" and "d" missing from the third.
SET_PARTS = [(1000, ["a", "b", "c", "d", "e"]), (517, ["c", "a", "x"]), (263, ["e", "b"])]
SET_CLASSES = ["a", "b", "c", "d", "e", "x"]


@dataclass(frozen=True)
class SetInfo:
    """The stores of a set and what the set must read: samples, class names per sample."""

    paths: list[Path]
    x: np.ndarray
    names: np.ndarray


def build_set(base: Path, parts: Sequence[tuple[int, list[str]]] = SET_PARTS, seed: int = 0) -> SetInfo:
    """Write one store per part; ``x[i].flat[0]`` is ``i``'s index in the set."""
    paths, xs, names, first = [], [], [], 0
    for k, (n, classes) in enumerate(parts):
        x, y = make_data(n, seed + k, n_classes=len(classes))
        x[:, 0, 0] = first + np.arange(n)
        paths.append(build_store(base / f"s{k}", x, y, classes=classes))
        xs.append(x)
        names.append(np.asarray(classes)[y])
        first += n
    return SetInfo(paths, np.concatenate(xs), np.concatenate(names))


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> SetInfo:
    """The default set (:data:`SET_PARTS`: three stores of 1,000, 517 and 263 samples), built once per test file."""
    return build_set(tmp_path_factory.mktemp("set"))
