"""lmdbstore: tens of millions of small training samples in LMDB, fed to PyTorch, Keras or TensorFlow at
full speed.

Public API (everything else is internal)::

    open_writer / StoreWriter      write samples and labels (bounded commits, resumable)
    write_parallel                 many producer processes, one writer, in task order (resumable); producers
                                   on a concurrent.futures executor, a Dask Client or Ray (executor=...)
    RayExecutor                    a concurrent.futures executor over Ray tasks (Ray imported when made)
    open_reader / StoreReader      random, batched and sequential reads; labels; class index
    StoreSet                       several stores read as one (open_reader([a, b, ...])): one index space
    StoreMeta                      the store's JSON metadata
    ingest / open_sources          validate files (or other stores) and append them, resumable
    verify_store                   check every value, label chunk, index entry and the metadata
    export_store / copy_store      data back out to .npy/.npz/HDF5; a consistent (compacted) copy
    show_samples / plot_runs / plot_stats   PNG pictures (matplotlib, the ``viz`` extra)
    stratified_split               the seeded per-class train/validation split ``train`` uses (numpy only)
    EpochBatchSampler, BalancedBatchSampler, WindowBatchSampler   epoch orders, DDP shares, resumable
    MixedBatchSampler / store_parts   fixed per-store shares of every epoch (weights=[0.7, 0.3])
    WriterConfig, LoaderConfig, TrainConfig, FeedConfig
    LmdbStoreError and subclasses  every deliberate error
    keras_dataset                  a keras.utils.PyDataset for model.fit, any backend              (keras)
    tf_dataset                     a tf.data.Dataset with known length                             (tensorflow)
    train / TrainResult            train the CNN on a store (one process or torchrun), resumable   (torch)
    evaluate                       score a store with a checkpoint of ``train``                    (torch)
    LmdbBatchDataset, make_loader  batches of a store through reader processes, as a DataLoader   (torch)

The framework names are resolved on first use (module ``__getattr__``), so ``import lmdbstore``, reading,
writing and the tools import none of torch, keras or tensorflow; without torch installed, the torch names
raise an ``ImportError`` naming the extra to install.  (The trainer's package is ``lmdbstore.training``;
``lmdbstore.train`` is the function.)
"""

from lmdbstore.config import FeedConfig, LoaderConfig, TrainConfig, WriterConfig
from lmdbstore.errors import (
    ChecksumError,
    CorruptStoreError,
    FormatVersionError,
    LmdbStoreError,
    ModelError,
    NotAStoreError,
    SourceError,
    StoreExistsError,
    StoreFullError,
    StoreLockedError,
    StoreNotFoundError,
    StoreReplacedError,
    TaskError,
    TrainingInterrupted,
    ValidationError,
)
from lmdbstore.format.layout import FORMAT_VERSION
from lmdbstore.format.meta import StoreMeta
from lmdbstore.ingestion.parallel import write_parallel
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.ray_executor import RayExecutor
from lmdbstore.ingestion.reports import IngestReport, ParallelReport
from lmdbstore.ingestion.sources.opening import open_sources
from lmdbstore.loader.mixing import MixedBatchSampler, store_parts
from lmdbstore.loader.samplers import BalancedBatchSampler, EpochBatchSampler, stratified_split
from lmdbstore.loader.window import WindowBatchSampler
from lmdbstore.store.multi import StoreSet
from lmdbstore.store.opening import open_writer
from lmdbstore.store.reader import StoreReader
from lmdbstore.store.readers import open_reader
from lmdbstore.store.writer import StoreWriter
from lmdbstore.tools.copy import CopyReport, copy_store
from lmdbstore.tools.export import ExportReport, export_store
from lmdbstore.tools.verify import VerifyReport, verify_store
from lmdbstore.tools.viz import plot_runs, plot_stats, show_samples
from lmdbstore.version import __version__

# public names that need a framework: name -> (module, the package it needs, the extra that installs it),
# imported on first access
_LAZY_NAMES = {
    "LmdbBatchDataset": ("frameworks.torch_data", "torch", "torch"),
    "make_loader": ("frameworks.torch_data", "torch", "torch"),
    "evaluate": ("training.evaluate", "torch", "torch"),
    "train": ("training.trainer", "torch", "torch"),
    "TrainResult": ("training.trainer", "torch", "torch"),
    "keras_dataset": ("frameworks.keras_data", "keras", "keras"),
    "tf_dataset": ("frameworks.tf_data", "tensorflow", "tensorflow"),
}


def __getattr__(name: str) -> object:
    """Import the framework parts of the public API on first use.

    Raises:
        ImportError: the framework is not installed (the message names the extra that installs it).
    """
    if name in _LAZY_NAMES:
        import importlib

        module, package, extra = _LAZY_NAMES[name]
        try:
            return getattr(importlib.import_module(f".{module}", __name__), name)
        except ModuleNotFoundError as exc:
            if exc.name != package:
                raise
            raise ImportError(
                f"lmdbstore.{name} needs {package}, which is not installed: pip install 'lmdbstore[{extra}]'",
                name=package,
            ) from exc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "BalancedBatchSampler",
    "CopyReport",
    "EpochBatchSampler",
    "ExportReport",
    "FeedConfig",
    "IngestReport",
    "LmdbBatchDataset",
    "MixedBatchSampler",
    "TrainResult",
    "VerifyReport",
    "WindowBatchSampler",
    "copy_store",
    "evaluate",
    "export_store",
    "ingest",
    "keras_dataset",
    "make_loader",
    "open_sources",
    "plot_runs",
    "plot_stats",
    "show_samples",
    "store_parts",
    "stratified_split",
    "tf_dataset",
    "train",
    "verify_store",
    "ChecksumError",
    "CorruptStoreError",
    "FormatVersionError",
    "LmdbStoreError",
    "ModelError",
    "LoaderConfig",
    "NotAStoreError",
    "ParallelReport",
    "RayExecutor",
    "SourceError",
    "StoreExistsError",
    "StoreFullError",
    "StoreLockedError",
    "StoreMeta",
    "StoreNotFoundError",
    "StoreReader",
    "StoreReplacedError",
    "StoreSet",
    "StoreWriter",
    "TaskError",
    "TrainingInterrupted",
    "TrainConfig",
    "ValidationError",
    "WriterConfig",
    "__version__",
    "open_reader",
    "open_writer",
    "write_parallel",
]
