"""Configuration as frozen dataclasses, with every default named once, here.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the offending parameter,
so a bad value fails where it is given.  Defaults that belong to no dataclass (a command's or a tool's) are
named constants at the end of this module, which the CLI shows and the library functions default to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lmdbstore.configcheck import BUILTIN_MODEL, OPTIMIZERS, check_int, check_model_fields, check_weights
from lmdbstore.format.checksums import CHECKSUM_KINDS, ChecksumKind
from lmdbstore.format.limits import DEFAULT_LABEL_CHUNK, DEFAULT_MAX_VALUE_BYTES
from lmdbstore.util.splits import check_val_fraction, check_val_limit

__all__ = [
    "DEFAULT_CAST",
    "DEFAULT_CHECK_WHOLE_VALUES",
    "DEFAULT_COMMIT_BYTES",
    "DEFAULT_COMPRESS",
    "DEFAULT_DEMO_DIR",
    "DEFAULT_DPI",
    "DEFAULT_EXPORT_CHUNK",
    "DEFAULT_PREFETCH",
    "DEFAULT_VAL_FRACTION",
    "DEFAULT_HIST_BINS",
    "DEFAULT_HIST_SAMPLES",
    "DEFAULT_INGEST_WORKERS",
    "DEFAULT_INITIAL_MAP_SIZE",
    "DEFAULT_LABEL_CHUNK",
    "DEFAULT_MAX_PROBLEMS",
    "DEFAULT_MAX_VALUE_BYTES",
    "DEFAULT_PER_CLASS",
    "DEFAULT_PROGRESS",
    "DEFAULT_RUNS_DIR",
    "DEFAULT_RUN_PNG",
    "DEFAULT_SAMPLES_PNG",
    "DEFAULT_SAMPLE_SEED",
    "DEFAULT_SYNTH_SAMPLES",
    "DEFAULT_SYNTH_SEED",
    "DEFAULT_VERIFY_CHECKSUMS",
    "DEFAULT_VERIFY_STRUCTURE",
    "DEFAULT_VERIFY_WORKERS",
    "DEFAULT_X_KEY",
    "DEFAULT_Y_KEY",
    "BUILTIN_MODEL",
    "OPTIMIZERS",
    "SAMPLE_READ_CHUNK",
    "SGD_MOMENTUM",
    "ChecksumKind",
    "FeedConfig",
    "LoaderConfig",
    "ShuffleMode",
    "TrainConfig",
    "WriterConfig",
]

ShuffleMode = Literal["auto", "random", "block", "window"]

#: Samples are buffered and committed once this many payload bytes are pending (bounded transactions).
DEFAULT_COMMIT_BYTES = 64 * 1024 * 1024
#: First LMDB map size of a new store; grown by doubling whenever a commit would not fit.
DEFAULT_INITIAL_MAP_SIZE = 1 << 30
#: Whether readers check the stored checksum of every value a batch reads whole (block and window orders) on
#: the offset path (``StoreReader(check_whole_values=...)``).  Off: it costs a large share of block-order read
#: throughput (docs/benchmarks.md); ``verify`` and ``verify_checksums`` check them.
DEFAULT_CHECK_WHOLE_VALUES = False


@dataclass(frozen=True)
class WriterConfig:
    """How a :class:`~lmdbstore.store.writer.StoreWriter` lays out and commits data.

    Attributes:
        samples_per_value, checksum: used when the store is created: samples packed into one LMDB value (``None``,
            default: the count that wastes the least of the last overflow page), and the per-value checksum
            (``"crc32"``, default, ``"xxh64"`` or ``"none"``).
        commit_bytes: payload bytes buffered before a transaction commits (default 64 MiB).
        initial_map_size: LMDB map size when the store is created (default 1 GiB); it doubles as needed.
        max_map_size: the map never grows past this; ``None`` means no limit but the disk.
        sync: fsync each commit (default ``True``): a committed batch survives power loss.
        allow_nonfinite: accept NaN/inf values in float samples (default ``False``).
    """

    samples_per_value: int | None = None
    checksum: ChecksumKind = "crc32"
    commit_bytes: int = DEFAULT_COMMIT_BYTES
    initial_map_size: int = DEFAULT_INITIAL_MAP_SIZE
    max_map_size: int | None = None
    sync: bool = True
    allow_nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.samples_per_value is not None and not 1 <= self.samples_per_value <= 1 << 20:
            raise ValueError(f"samples_per_value must be in 1..{1 << 20}, got {self.samples_per_value}")
        if self.checksum not in CHECKSUM_KINDS:
            raise ValueError(f"checksum must be one of {', '.join(map(repr, CHECKSUM_KINDS))}, got {self.checksum!r}")
        if self.commit_bytes < 1:
            raise ValueError(f"commit_bytes must be positive, got {self.commit_bytes}")
        if self.initial_map_size < 1 << 20:
            raise ValueError(f"initial_map_size must be at least 1 MiB, got {self.initial_map_size}")
        if self.max_map_size is not None and self.max_map_size < 1 << 16:
            raise ValueError(f"max_map_size must be at least 64 KiB, got {self.max_map_size}")
        if self.max_map_size is not None and self.initial_map_size > self.max_map_size:
            raise ValueError(
                f"initial_map_size ({self.initial_map_size}) must not exceed max_map_size ({self.max_map_size})"
            )


#: Batches each reader process works ahead.
DEFAULT_PREFETCH = 2
#: Share of every class a ``"val"`` split holds (and ``lmdbstore train`` validates on).
DEFAULT_VAL_FRACTION = 0.1


@dataclass(frozen=True)
class LoaderConfig:
    """What a loader reads, in which order, and how: one config for every adapter (``make_loader``, ``keras_dataset``,
    ``tf_dataset``, the trainer; ``FeedConfig`` is the same class).  docs/api.md's table says more of each field.

    Attributes:
        batch_size: samples per batch (default 4096).
        split, val_fraction: ``None`` (default: every sample), ``"train"`` or ``"val"``: that part of the seeded,
            stratified split ``lmdbstore train`` uses (``val_fraction`` of every class, default 0.1, or a count),
            drawn over the store as the loader opens it.
        shuffle: ``"random"``, ``"block"`` (whole packed values in shuffled order), ``"window"`` (stores bigger than
            RAM), ``"auto"`` (``random`` if the store fits in the page cache, else ``window``) or ``"none"``;
            ``None`` (default): ``"none"`` for ``split="val"``, else ``"auto"``.
        balanced: draw classes equally, with replacement; weights: per store of a set, its exact share of every
            epoch, e.g. ``(0.7, 0.3)`` (random order only).
        window_mb: window of ``"window"`` in MiB (default ``None``: an eighth of available memory).
        block_buffer: block order: over how many batches each value's samples are spread (default 2).
        seed: base seed of every order and of each batch's transform generators.
        workers: reader processes (default 2; 0 reads in the consuming thread); prefetch: batches each works
            ahead (default 2).
        persistent_workers: readers wait between passes (default ``True``); ``False``: they stop after each.
        multiprocessing_context: the readers' start method (``None``: ``fork``, or ``forkserver`` once TensorFlow's
            or JAX's runtime runs; ``spawn`` off Linux).
        channels: ``"first"`` ((N, 1, H, W)), ``"last"`` ((N, H, W, 1)) or ``"stored"``; ``None``: the adapter's.
        drop_last: leave out the last, short batch.
        pin_memory: page-lock the slots for asynchronous host-to-GPU copies; ``None``: when CUDA is used (the
            trainer), ``False`` in ``make_loader``.
    """

    batch_size: int = 4096
    split: Literal["train", "val"] | None = None
    val_fraction: float = DEFAULT_VAL_FRACTION
    shuffle: ShuffleMode | Literal["none"] | None = None
    balanced: bool = False
    weights: tuple[float, ...] | None = None
    window_mb: int | None = None
    block_buffer: int = 2
    seed: int = 0
    workers: int = 2
    prefetch: int = DEFAULT_PREFETCH
    persistent_workers: bool = True
    multiprocessing_context: str | None = None
    channels: Literal["first", "last", "stored"] | None = None
    drop_last: bool = False
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        check_weights(self.weights, self.shuffle, self.balanced)
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(float(v) for v in self.weights))
        check_int("batch_size", self.batch_size, 1)
        check_int("block_buffer", self.block_buffer, 1)
        check_int("workers", self.workers, 0)
        check_int("prefetch", self.prefetch, 1)
        check_int("seed", self.seed, None)
        if self.window_mb is not None:
            check_int("window_mb", self.window_mb, 1)
        if self.split not in (None, "train", "val"):
            raise ValueError(f"split must be None, 'train' or 'val', got {self.split!r}")
        check_val_fraction(self.val_fraction)
        if self.shuffle not in (None, "none", "auto", "random", "block", "window"):
            raise ValueError(f"shuffle must be 'auto', 'random', 'block', 'window' or 'none', got {self.shuffle!r}")
        if self.multiprocessing_context not in (None, "fork", "spawn", "forkserver"):
            raise ValueError(
                "multiprocessing_context must be None, 'fork', 'spawn' or 'forkserver', "
                f"got {self.multiprocessing_context!r}"
            )
        if self.channels not in (None, "first", "last", "stored"):
            raise ValueError(f"channels must be None, 'first', 'last' or 'stored', got {self.channels!r}")

    @property
    def order(self) -> str:
        """The shuffle this config asks for (``None`` resolved by ``split`` and ``weights``)."""
        if self.shuffle is not None:
            return self.shuffle
        if self.weights is not None:
            return "random"
        return "none" if self.split == "val" else "auto"


#: The same class under the name the Keras and tf.data adapters documented.
FeedConfig = LoaderConfig


#: Largest CNN ``width`` (first-block channels): about 1.2 G parameters, far beyond what the CNN needs.
MAX_WIDTH = 4096

#: Momentum of ``optimizer="sgd"`` (the one-cycle schedule cycles it between 0.85 and this value).
SGD_MOMENTUM = 0.9


@dataclass(frozen=True)
class TrainConfig:
    """What :func:`lmdbstore.training.trainer.train` does.

    Attributes:
        epochs: passes over the training split (default 3).
        lr: peak learning rate of AdamW with a one-cycle schedule (default 3e-3).
        weight_decay: AdamW weight decay (default 1e-4).
        val_fraction: share of every class held out for validation (stratified, seeded; default 0.1), or a count (>= 2).
        width: channels of the first convolution block of the CNN; later blocks double it (default 16).
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        amp: mixed precision (bfloat16 autocast) on CUDA; ignored on CPU (default ``True``).
        max_steps_per_epoch: cut epochs short (for smoke tests and benchmarks); ``None`` = full epochs.
        log_every: the step loss and learning rate go to TensorBoard every this many steps (default 10).
        checkpoint_every: also write ``checkpoint.pt`` every this many optimizer steps, inside epochs, so
            that ``resume`` continues inside the epoch (default ``None``: at the end of each epoch only).
        model, model_args: the model factory, ``"module:function"`` or ``"path/to/file.py:function"``
            (:mod:`lmdbstore.training.factory`; default :data:`BUILTIN_MODEL`), and its arguments (JSON scalars).
        optimizer: ``"adamw"`` (default) or ``"sgd"`` (momentum :data:`SGD_MOMENTUM`); label_smoothing: of the
            training loss (default 0); compile: steps through ``torch.compile`` (default ``False``).
        allow_disjoint_classes: train on a set where a store of bare class ids (``0..k-1``) shares no name with
            the others' named classes (default ``False``: refused).
        val_every: also validate every this many steps, inside epochs (default ``None``: at each epoch's end only).
        val_limit: what one validation reads: all of the split (``None``, default), batches a process (an int) or a
            share (a float in (0, 1]): a fixed stratified subset (:mod:`lmdbstore.training.validation`).
    """

    epochs: int = 3
    lr: float = 3e-3
    weight_decay: float = 1e-4
    val_fraction: float = DEFAULT_VAL_FRACTION
    width: int = 16
    device: str = "auto"
    amp: bool = True
    max_steps_per_epoch: int | None = None
    log_every: int = 10
    checkpoint_every: int | None = None
    model: str = BUILTIN_MODEL
    model_args: Any = ()
    optimizer: str = "adamw"
    label_smoothing: float = 0.0
    compile: bool = False
    allow_disjoint_classes: bool = False
    val_every: int | None = None
    val_limit: int | float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_args", check_model_fields(self, TrainConfig.width))  # sorted pairs
        for name in ("epochs", "log_every", "max_steps_per_epoch", "checkpoint_every"):
            if (value := getattr(self, name)) is not None:
                check_int(name, value, 1)
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        check_val_fraction(self.val_fraction)
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"width must be in 1..{MAX_WIDTH}, got {self.width}")
        check_val_limit(self.val_limit, self.val_every)

    @property
    def model_kwargs(self) -> dict[str, Any]:
        """The factory's keyword arguments: ``model_args``, and for the built-in CNN its ``width``."""
        return {"width": self.width, **dict(self.model_args)} if self.model == BUILTIN_MODEL else dict(self.model_args)


# ------------------------------------------------------------------------ defaults of commands and tools
# (values no dataclass above holds; the CLI shows them, the library functions default to them)

#: Show progress bars (commands' ``--progress/--no-progress``): ``None`` shows them when stderr is a terminal.
DEFAULT_PROGRESS: bool | None = None

#: Samples of the built-in synthetic dataset ``lmdbstore synth`` writes and ``lmdbstore demo`` ingests.
DEFAULT_SYNTH_SAMPLES = 100_000
#: Seed of the built-in synthetic dataset (``synth``, ``ingest --synthetic``).
DEFAULT_SYNTH_SEED = 0

#: Name of the sample array in an ``.npz`` source and of the sample dataset in an HDF5 source.
DEFAULT_X_KEY = "x"
#: Name of the label array in an ``.npz`` source and of the label dataset in an HDF5 source.
DEFAULT_Y_KEY = "y"
#: Convert ingested samples of another dtype of the same kind (off: such sources are refused).
DEFAULT_CAST = False
#: Processes that read and validate ingest sources (0: the ingesting process itself).
DEFAULT_INGEST_WORKERS = 0

#: ``verify``: check per-value checksums (when the store has them).
DEFAULT_VERIFY_CHECKSUMS = True
#: ``verify``: check LMDB's page structure first.
DEFAULT_VERIFY_STRUCTURE = True
#: ``verify``: problems listed before it stops listing.
DEFAULT_MAX_PROBLEMS = 20
#: ``verify``: processes reading and checksumming the values; ``None``: the cores (one per 512 MiB of values at most).
DEFAULT_VERIFY_WORKERS: int | None = None

#: Samples an export reads and writes per step (64 Ki samples of 25x25 float32 = 160 MiB would be too
#: much; 16 Ki = 40 MiB).
DEFAULT_EXPORT_CHUNK = 16384
#: Deflate exported ``.npz`` members / gzip exported HDF5 samples (off: stored, as ``np.savez``).
DEFAULT_COMPRESS = False

#: Samples read per step when a tool reads a random sample (``stats --sample``, the histogram of
#: ``plot_stats``), so memory stays at one chunk.
SAMPLE_READ_CHUNK = 4096
#: Seed of the random samples ``stats --sample`` reads and the pictures draw.
DEFAULT_SAMPLE_SEED = 0

#: Pixels per inch of the PNG pictures (``show``, ``plot``, ``stats --plot``).
DEFAULT_DPI = 100
#: Samples per class ``show`` draws.
DEFAULT_PER_CLASS = 8
#: Random samples behind the value histogram of ``plot_stats`` (``stats --plot``).
DEFAULT_HIST_SAMPLES = 20_000
#: Bins of that histogram.
DEFAULT_HIST_BINS = 100
#: The PNG ``show`` writes.
DEFAULT_SAMPLES_PNG = "samples.png"
#: The PNG ``plot`` writes, and ``train --plot`` writes into the run directory.
DEFAULT_RUN_PNG = "run.png"

#: ``train`` puts a run in ``DEFAULT_RUNS_DIR/<store name>`` unless given ``--out``.
DEFAULT_RUNS_DIR = "runs"
#: Where ``demo`` puts its store and its run.
DEFAULT_DEMO_DIR = "demo_out"
