"""lmdbstore: tens of millions of small training samples in LMDB, fed to PyTorch at full speed.

Public API (everything else is internal)::

    open_writer / StoreWriter      write samples and labels (bounded commits, resumable)
    write_parallel                 many producer processes, one writer, in task order (resumable)
    open_reader / StoreReader      random, batched and sequential reads; labels; class index
    StoreMeta                      the store's JSON metadata
    WriterConfig, LoaderConfig, TrainConfig
    LmdbStoreError and subclasses  every deliberate error

The torch parts (``lmdbstore.dataset``, ``lmdbstore.samplers``, ``lmdbstore.model``,
``lmdbstore.train``) are imported on first use so that writing a store does not import torch.
"""

__version__ = "0.1.0"

from .config import LoaderConfig, TrainConfig, WriterConfig
from .errors import (
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
from .format import FORMAT_VERSION, StoreMeta
from .parallel import ParallelReport, write_parallel
from .reader import StoreReader, open_reader
from .writer import StoreWriter, open_writer

__all__ = [
    "FORMAT_VERSION",
    "ChecksumError",
    "CorruptStoreError",
    "FormatVersionError",
    "LmdbStoreError",
    "LoaderConfig",
    "NotAStoreError",
    "ParallelReport",
    "SourceError",
    "StoreExistsError",
    "StoreFullError",
    "StoreLockedError",
    "StoreMeta",
    "StoreNotFoundError",
    "StoreReader",
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
