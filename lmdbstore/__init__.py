"""lmdbstore: tens of millions of small training samples in LMDB, fed to PyTorch at full speed.

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
    WriterConfig, LoaderConfig, TrainConfig
    LmdbStoreError and subclasses  every deliberate error
    train / TrainResult            train the CNN on a store (one process or torchrun), resumable   (torch)
    evaluate                       score a store with a checkpoint of ``train``                    (torch)
    LmdbBatchDataset, make_loader  batches of a store through DataLoader workers                   (torch)
    EpochBatchSampler, BalancedBatchSampler, WindowBatchSampler   epoch orders, DDP shares         (torch)

The torch names are resolved on first use (module ``__getattr__``), so ``import lmdbstore`` and writing a
store do not import torch.  (The trainer's package is ``lmdbstore.training``; ``lmdbstore.train`` is the
function.)
"""

from lmdbstore.config import LoaderConfig, TrainConfig, WriterConfig
from lmdbstore.errors import (
    ChecksumError,
    CorruptStoreError,
    FormatVersionError,
    LmdbStoreError,
    NotAStoreError,
    SourceError,
    StoreExistsError,
    StoreFullError,
    StoreLockedError,
    StoreNotFoundError,
    TaskError,
    ValidationError,
)
from lmdbstore.format.layout import FORMAT_VERSION
from lmdbstore.format.meta import StoreMeta
from lmdbstore.ingestion.parallel import write_parallel
from lmdbstore.ingestion.pipeline import ingest
from lmdbstore.ingestion.ray_executor import RayExecutor
from lmdbstore.ingestion.reports import IngestReport, ParallelReport
from lmdbstore.ingestion.sources.opening import open_sources
from lmdbstore.loader.samplers import stratified_split
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

# public names that need torch: name -> module, imported on first access
_TORCH_NAMES = {
    "LmdbBatchDataset": "loader.dataset",
    "make_loader": "loader.dataset",
    "EpochBatchSampler": "loader.samplers",
    "BalancedBatchSampler": "loader.samplers",
    "WindowBatchSampler": "loader.window",
    "evaluate": "training.evaluate",
    "train": "training.trainer",
    "TrainResult": "training.trainer",
}


def __getattr__(name: str) -> object:
    """Import the torch parts of the public API on first use."""
    if name in _TORCH_NAMES:
        import importlib

        return getattr(importlib.import_module(f".{_TORCH_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "BalancedBatchSampler",
    "CopyReport",
    "EpochBatchSampler",
    "ExportReport",
    "IngestReport",
    "LmdbBatchDataset",
    "TrainResult",
    "VerifyReport",
    "WindowBatchSampler",
    "copy_store",
    "evaluate",
    "export_store",
    "ingest",
    "make_loader",
    "open_sources",
    "plot_runs",
    "plot_stats",
    "show_samples",
    "stratified_split",
    "train",
    "verify_store",
    "ChecksumError",
    "CorruptStoreError",
    "FormatVersionError",
    "LmdbStoreError",
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
    "StoreSet",
    "StoreWriter",
    "TaskError",
    "TrainConfig",
    "ValidationError",
    "WriterConfig",
    "__version__",
    "open_reader",
    "open_writer",
    "write_parallel",
]
