"""Every benchmark, declared: its data, its rows, each row's baselines and its one goal.  The goals are the
project's (issues 33, 36, 41 and 42); a measurement that had two goals in two scripts keeps the newer one.

Benchmarks on the same data share what they build when they are given the same ``--store-dir``: ``readpath``,
``frameworks``, ``formats``, ``peers`` and ``verify`` read the same 1M-sample float32 store, ``feed`` and ``sets``
the same 2M-sample float16 one.
"""

from __future__ import annotations

from .formats import format_read, peer_epoch
from .jobs import demo, gpu_way, npsave, parallel, sampler_memory, tfrecord, train, verify, writer
from .measures import built, disk_bytes, feed_epochs, loader_epoch, memmap, pread, read_batch, seq_read, seq_write
from .spec import Baseline, Benchmark, Data, Measure, Row, at_least, at_most

ONE_M = Data(1_000_000, "float32", quick=40_000)
TWO_M = Data(2_000_000, "float16", quick=40_000)


def bracket(m: Measure) -> Baseline:
    return Baseline(m, "bracket")


def recorded(m: Measure, key: str | None = None) -> Baseline:
    return Baseline(m, "recorded", key)


def first_batch(m: Measure, within: float) -> Row:
    """The wait for the first batch of the cold epoch ``m`` (measured by the row before)."""
    return Row(
        f"first batch, cold {m.label.split(', ')[1]} epoch",
        m,
        key="first_batch_s",
        unit="s",
        goal=at_most(within, "figure"),
    )


RANDOM, BLOCK, WINDOW = (loader_epoch(o, cold=True) for o in ("random", "block", "window"))
WARM_RANDOM = read_batch("random", cold=False)


def set_rows(when: str) -> tuple[Row, ...]:
    """A set of 4 stores against one store of the same samples, warm and cold; the one store's figures taken each
    round (``when="round"``) or as recorded by the rows before."""
    return (
        Row(
            "set of 4, warm random",
            read_batch("random", cold=False, kind="set4"),
            baselines=(Baseline(WARM_RANDOM, when),),
            goal=at_least(0.9),
        ),
        Row(
            "set of 4, cold window epoch",
            loader_epoch("window", cold=True, kind="set4"),
            baselines=(Baseline(WINDOW, when),),
            goal=at_least(0.9),
        ),
    )


READPATH = Benchmark(
    "readpath",
    "`read_batch` cold and warm, against the disk's limits and a numpy memmap",
    "One process reads random and block-order batches of 4096 with `StoreReader.read_batch`.  Cold: the store's pages "
    "dropped after it is opened, against random `pread`s of the same bytes (one sample, or one whole value) at 16 "
    "(and 64) in flight on the same file, measured right before and after each round.  Warm: the same batches read "
    "twice into one buffer, against a numpy memmap of the same samples (`np.take`, or slices).  The store is 2.5 GB: "
    "a cold round of 6 s reads much of it, so its later batches hit pages the round brought in and the cold "
    "figures here are upper bounds; scale's rows (a store twice the RAM) are the cold read path's figures.",
    data=ONE_M,
    rows=(
        Row(
            "cold random",
            read_batch("random", cold=True),
            baselines=(bracket(pread("sample", 16)), bracket(pread("sample", 64))),
            goal=at_least(0.8),
        ),
        Row("cold block", read_batch("block", cold=True), baselines=(bracket(pread("value", 16)),), goal=at_least(0.8)),
        Row("warm random", WARM_RANDOM, baselines=(Baseline(memmap("random")),), goal=at_least(1.5)),
        Row(
            "warm contiguous ranges",
            read_batch("ranges", cold=False),
            baselines=(Baseline(memmap("ranges")),),
            goal=at_least(0.9),
        ),
    ),
)

FEED = Benchmark(
    "feed",
    "`make_loader`'s cold epochs: the first batch, and a window-order epoch against the disk's sequential read",
    "`make_loader(workers=2)` over a store whose pages are dropped once the loader is made: the wait for an epoch's first "
    "batch in each order, and the samples/s of a window-order epoch against the sequential read of the same file "
    "(measured right before and after), alone and with another job (a process spinning on one core) running.",
    data=TWO_M,
    overrides=("samples", "dtype"),
    rows=(
        first_batch(RANDOM, 0.1),
        first_batch(BLOCK, 0.1),
        Row("cold window epoch", WINDOW, baselines=(bracket(seq_read()),), goal=at_least(0.9)),
        first_batch(WINDOW, 0.1),
        Row(
            "cold window epoch, another job running",
            loader_epoch("window", cold=True, job=True),
            baselines=(bracket(seq_read()),),
            goal=at_least(0.9),
        ),
    ),
)

SETS = Benchmark(
    "sets",
    "A set of 4 stores read as one, against one store of the same samples",
    "The same samples as one store and as a set of four stores of a quarter each (`open_reader([...])`), in turn "
    "each round: warm random batches read into one buffer in one process, and a cold window-order epoch through "
    "`make_loader(workers=2)`.",
    data=TWO_M,
    overrides=("samples", "dtype"),
    rows=set_rows("round"),
)

FRAMEWORKS = Benchmark(
    "frameworks",
    "The feed under every framework, against one in-process reader",
    "Whole epochs of the training split in random order, data only, warm: `make_loader`, `tf_dataset` and "
    "`keras_dataset` with 2 reader processes each, and `read_batch(out=)` in one process; each row's contenders in "
    "turn each round, epoch starts included, after an untimed epoch.  Then `lmdbstore train` (CPU, 2 readers): the "
    "share of the run spent waiting for data.",
    data=ONE_M,
    needs=("torch", "tensorflow", "keras", "psutil"),
    rows=(
        Row(
            "make_loader, batch 4096",
            feed_epochs("make_loader", 4096),
            baselines=(Baseline(feed_epochs("read_batch", 4096)),),
            goal=at_least(1.5),
        ),
        Row(
            "make_loader, batch 256",
            feed_epochs("make_loader", 256),
            baselines=(Baseline(feed_epochs("read_batch", 256)),),
            goal=at_least(1.0),
        ),
        *(
            Row(
                f"{how}, batch {b}",
                feed_epochs(how, b),
                baselines=(Baseline(feed_epochs("make_loader", b)),),
                goal=at_least(0.9),
            )
            for how in ("tf_dataset", "keras_dataset")
            for b in (4096, 1024)
        ),
        Row("train: data wait (CPU, warm)", train(), key="data_wait", unit="share", goal=at_most(0.05, "figure")),
    ),
)

FORMATS = Benchmark(
    "formats",
    "lmdbstore against the usual ways of storing many small samples",
    "The same samples in each format (HDF5 contiguous and chunked, SQLite, LMDB with one key per sample, one `.npy` "
    "file per sample): bytes on disk per sample, and warm random batches of 4096 in one process, `read_batch` "
    "against each format's own reads in turn each round (ratios: lmdbstore's rate over the format's).",
    data=ONE_M,
    needs=("h5py",),
    rows=(
        Row(
            "bytes on disk per sample",
            disk_bytes("store"),
            key="bytes",
            unit="B",
            baselines=(
                recorded(disk_bytes("raw")),
                recorded(disk_bytes("lmdb1", "LMDB, one key per sample")),
                recorded(disk_bytes("sqlite", "SQLite, BLOB per row")),
            ),
            goal=at_most(1.05),
        ),
        Row(
            "warm random vs HDF5",
            WARM_RANDOM,
            baselines=(Baseline(format_read("h5", "per sample")),),
            goal=at_least(10),
        ),
        Row(
            "warm random vs HDF5 chunked", WARM_RANDOM, baselines=(Baseline(format_read("h5chunked", "sorted batch")),)
        ),
        Row("warm random vs SQLite", WARM_RANDOM, baselines=(Baseline(format_read("sqlite", "IN batch")),)),
        Row(
            "warm random vs LMDB, key per sample",
            WARM_RANDOM,
            baselines=(Baseline(format_read("lmdb1", "txn.get per sample")),),
            goal=at_least(3),
        ),
        Row("warm random vs .npy files", WARM_RANDOM, baselines=(Baseline(format_read("npyfiles", "np.load each")),)),
    ),
)

PEERS = Benchmark(
    "peers",
    "lmdbstore beside the loaders people pick today",
    "MosaicML streaming (MDS), litdata and webdataset, each written with its own writer: warm random batches in one "
    "process through its random access, and a shuffled epoch through its own loader with 2 workers, against "
    "`read_batch` and `make_loader(workers=2)`.  (MDS and litdata shuffle shards and then samples in a window; "
    "webdataset has no random access and shuffles in a 5,000-sample buffer.)",
    data=ONE_M,
    needs=("streaming", "litdata", "webdataset", "torch"),
    rows=(
        Row("warm random vs MDS", WARM_RANDOM, baselines=(Baseline(format_read("mds", "get_item each")),)),
        Row("warm random vs litdata", WARM_RANDOM, baselines=(Baseline(format_read("litdata", "[i] each")),)),
        *(
            Row(f"shuffled epoch vs {who}", loader_epoch("random", cold=False), baselines=(Baseline(peer_epoch(k)),))
            for k, who in (("mds", "MDS"), ("litdata", "litdata"), ("wds", "webdataset"))
        ),
    ),
)

INGEST = Benchmark(
    "ingest",
    "Writing: the single writer against np.save, write_parallel's producers, a TFRecord ingest",
    "The writer appending ready arrays of 4096 25x25 float32 samples (crc32, an fsync a commit) against `np.save` "
    "of the same bytes; `write_parallel` of a producer whose tasks cost 50 ms here (an augmentation's numpy passes) "
    "on 2 local workers and on a Dask `LocalCluster` of 2 processes, against 1 local worker; TFRecord shards written "
    "by TensorFlow ingested by `lmdbstore ingest` with TensorFlow unimportable (the store checked equal to them).",
    needs=("distributed", "tensorflow", "google_crc32c"),
    overrides=(),
    rows=(
        Row("single writer", writer(), baselines=(Baseline(npsave()),), goal=at_least(0.5)),
        Row("write_parallel, 2 local workers", parallel("2"), baselines=(Baseline(parallel("1")),)),
        Row(
            "write_parallel, Dask LocalCluster(2)",
            parallel("dask2"),
            baselines=(Baseline(parallel("1")),),
            goal=at_least(1.4),
        ),
        Row("TFRecord ingest", tfrecord(), baselines=(Baseline(writer()),)),
    ),
)

VERIFY = Benchmark(
    "verify",
    "`verify_store` against the disk's sequential read",
    "`verify_store` with every core on a store whose pages were dropped after open, against the sequential read of "
    "its file measured right before and after.",
    data=ONE_M,
    rows=(Row("verify_store, cold", verify(), baselines=(bracket(seq_read()),), goal=at_least(0.5)),),
)

MEMORY = Benchmark(
    "memory",
    "The trainer's split and samplers: the main process's peak against its steady memory",
    "In a fresh process per order: a label table of the samples, the stratified 10 % split and the order's "
    "training sampler (its first 50 batches), as the trainer makes them (numpy only, no store): resident MiB at the "
    "peak against the level it keeps.",
    data=Data(40_000_000, quick=200_000),
    rows=tuple(
        Row(
            f"{o} sampler, peak / steady",
            sampler_memory(o),
            key="peak",
            unit="MiB",
            baselines=(recorded(sampler_memory(o), "steady"),),
            goal=at_most(1.2),
        )
        for o in ("random", "block", "window", "balanced")
    ),
)

_TRAIN = train(kill=True, cold=True)
SCALE = Benchmark(
    "scale",
    "The seed's scale: every command at 40M samples, twice the RAM",
    "A 40M-sample float16 store (about 50 GB) built with `write_parallel`; verify; cold epochs through "
    "`make_loader(workers=2)` in every order against the disk's limits measured right before and after (random: "
    "`pread` of one sample at 16 and 64 in flight; block: of one value; window: the sequential read), and each "
    "one's first batch; `lmdbstore train` of 300 steps: data wait, main-process memory, and the same run killed at a "
    "checkpoint and resumed; then the same samples as a set of 4 stores (the one store removed first when the disk "
    "cannot hold both) against the one store's figures.",
    data=Data(40_000_000, "float16", quick=20_000),
    needs=("psutil", "torch"),
    overrides=("samples", "dtype"),
    rows=(
        Row("build: write_parallel, 2 producers", built("store"), baselines=(Baseline(seq_write()),)),
        Row(
            "store on disk / raw",
            disk_bytes("store"),
            key="bytes",
            unit="B",
            baselines=(recorded(disk_bytes("raw")),),
            goal=at_most(1.02),
        ),
        Row("verify_store, cold", verify(), baselines=(bracket(seq_read()),), goal=at_least(0.5)),
        Row(
            "cold random epoch",
            RANDOM,
            baselines=(bracket(pread("sample", 16)), bracket(pread("sample", 64))),
            goal=at_least(0.8),
        ),
        first_batch(RANDOM, 0.3),
        Row(
            "cold block epoch", BLOCK, baselines=(bracket(pread("value", 16)), bracket(seq_read())), goal=at_least(0.8)
        ),
        first_batch(BLOCK, 0.3),
        Row("cold window epoch", WINDOW, baselines=(bracket(seq_read()),), goal=at_least(0.8)),
        first_batch(WINDOW, 0.3),
        Row("warm random, one store", WARM_RANDOM),
        Row("train: data wait (cold)", _TRAIN, key="data_wait", unit="share", goal=at_most(0.05, "figure")),
        Row(
            "train: main process private memory, peak / steady",
            _TRAIN,
            key="peak",
            unit="MiB",
            baselines=(recorded(_TRAIN, "steady"),),
            goal=at_most(1.2),
        ),
        Row(
            "train: killed at a checkpoint, resumed: bit-identical",
            _TRAIN,
            key="identical",
            unit="yes/no",
            goal=at_least(1, "figure"),
        ),
        *set_rows("recorded"),
    ),
)

GPU = Benchmark(
    "gpu",
    "Batches into a GPU, and training on one",
    "`make_loader` (8 readers, random order, warm) bringing batches to the GPU, data only: page-locked slots "
    '(`pin_memory=True`) and staged batches (`device="cuda"`) against pageable batches copied with `.to`; then '
    "`lmdbstore train` on the GPU at widths 16 and 64: the share of the run spent waiting for data.",
    data=Data(300_000, "float32", quick=20_000),
    needs=("torch", "cuda", "psutil"),
    rows=(
        Row("pinned batches to the GPU", gpu_way("pinned"), baselines=(Baseline(gpu_way("pageable")),)),
        Row("staged batches to the GPU", gpu_way("staged"), baselines=(Baseline(gpu_way("pageable")),)),
        *(
            Row(
                f"train on the GPU, width {w}: data wait",
                train(device="cuda", width=w, workers=8),
                key="data_wait",
                unit="share",
                goal=at_most(0.05, "figure"),
            )
            for w in (16, 64)
        ),
    ),
)

_DEMO = demo()
DEMO = Benchmark(
    "demo",
    "The main job end to end",
    "`lmdbstore demo`: 100,000 synthetic samples of a learnable 5-class dataset synthesized into a store, stats, "
    "3 epochs of the CNN at batch 4096 with 2 readers on the CPU, eval of the best checkpoint.",
    needs=("torch",),
    overrides=(),
    rows=(
        Row("validation accuracy after 3 epochs", _DEMO, key="accuracy", unit="share", goal=at_least(0.97, "figure")),
        Row("wall time, all four steps", _DEMO, key="seconds", unit="s"),
    ),
)

#: Every benchmark, in the order the docs show them.
SUITES = {
    b.name: b for b in (DEMO, READPATH, FEED, SETS, FRAMEWORKS, FORMATS, PEERS, INGEST, VERIFY, MEMORY, SCALE, GPU)
}
