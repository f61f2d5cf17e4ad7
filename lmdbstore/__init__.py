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

Every name is imported on first use (module ``__getattr__``): reading, writing and the tools import none of
torch, keras or tensorflow; without a framework installed, its names raise an ``ImportError`` naming the extra.
"""

from __future__ import annotations

import importlib

from lmdbstore import errors
from lmdbstore.version import __version__

#: public name -> the module (under ``lmdbstore.``) that defines it
_PUBLIC = {
    **dict.fromkeys(("FeedConfig", "LoaderConfig", "TrainConfig", "WriterConfig"), "config"),
    **dict.fromkeys((n for n in errors.__all__ if n[0].isupper()), "errors"),  # every error class
    "FORMAT_VERSION": "format.layout",
    "StoreMeta": "format.meta",
    "write_parallel": "ingestion.parallel",
    "ingest": "ingestion.pipeline",
    "RayExecutor": "ingestion.ray_executor",
    "IngestReport": "ingestion.reports",
    "ParallelReport": "ingestion.reports",
    "open_sources": "ingestion.sources.opening",
    "MixedBatchSampler": "loader.mixing",
    "store_parts": "loader.mixing",
    "BalancedBatchSampler": "loader.samplers",
    "EpochBatchSampler": "loader.samplers",
    "stratified_split": "loader.samplers",
    "WindowBatchSampler": "loader.window",
    "StoreSet": "store.multi",
    "open_writer": "store.opening",
    "StoreReader": "store.reader",
    "open_reader": "store.readers",
    "StoreWriter": "store.writer",
    "CopyReport": "tools.copy",
    "copy_store": "tools.copy",
    "ExportReport": "tools.export",
    "export_store": "tools.export",
    "VerifyReport": "tools.verify",
    "verify_store": "tools.verify",
    "plot_runs": "tools.viz",
    "plot_stats": "tools.viz",
    "show_samples": "tools.viz",
    "LmdbBatchDataset": "frameworks.torch_data",
    "make_loader": "frameworks.torch_data",
    "evaluate": "training.evaluate",
    "train": "training.trainer",
    "TrainResult": "training.trainer",
    "keras_dataset": "frameworks.keras_data",
    "tf_dataset": "frameworks.tf_data",
}
#: modules that need a framework: module -> (the package it needs, the extra that installs it)
_NEEDS = {
    "frameworks.torch_data": ("torch", "torch"),
    "training.evaluate": ("torch", "torch"),
    "training.trainer": ("torch", "torch"),
    "frameworks.keras_data": ("keras", "keras"),
    "frameworks.tf_data": ("tensorflow", "tensorflow"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> object:
    """Import a public name's module on first use (and keep the name here, so the next access is plain).

    Raises:
        ImportError: its framework is not installed (the message names the extra that installs it).
        AttributeError: ``name`` is not public.
    """
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    except ModuleNotFoundError as exc:
        package, extra = _NEEDS.get(module, (None, None))
        if package is None or exc.name != package:
            raise
        raise ImportError(
            f"lmdbstore.{name} needs {package}, which is not installed: pip install 'lmdbstore[{extra}]'",
            name=package,
        ) from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
