"""Ingest sources: the files samples come from, opened for streaming.

:func:`open_source` turns a path into one or more :class:`Source` objects, each ``len(src)`` samples of
``src.shape`` and ``src.dtype`` with labels, read ``batch`` rows at a time into fresh arrays (not ``mmap``:
mapped pages count towards the process RSS).

Kinds (the path decides):

``.npy``
    A stack ``(N, *shape)`` (ndim >= 2).  Holds no labels, so ``label=CLASS`` is required.
``.npz``
    Sample array ``x_key`` (default ``"x"``), label array ``y_key`` (default ``"y"``: class ids or
    class names), optional ``class_names`` array.  The members are streamed straight from the zip
    (stored or deflated): ``np.load`` would decompress a whole member into memory.  When the archive
    has ``class_names`` and integer labels, the ids index ``class_names`` and the source yields names.
``.h5`` / ``.hdf5``
    Datasets ``x_key`` and ``y_key`` (defaults ``"x"``, ``"y"``), optional ``class_names`` dataset;
    needs the optional ``h5py`` dependency.
``.tfrecord`` / ``.tfrecords`` (and shards ``NAME.tfrecord-00003-of-00016``)
    ``tf.train.Example`` records, sample feature ``x_key``, label feature ``y_key``; the sample as raw bytes
    (``dtype`` and ``sample_shape`` given) or a float/int64 list.  A directory of them is a set of shards, one
    source per file.  Read without TensorFlow; needs the optional ``google-crc32c``.
directory ``ROOT/<class>/*.npy``
    Each file one sample or a stack of samples, labelled by its subdirectory.  One source per class
    subdirectory (so the resume ledger has one entry per class, not per file); files in name order;
    tiny single-sample files are gathered into full batches.

``label=`` (a class name or class id) labels every sample of an ``.npy``, ``.npz`` or HDF5 source;
for ``.npz``/HDF5 it replaces the file's own label array, which then need not exist.

Every error is a one-line :class:`~lmdbstore.errors.SourceError` (cannot read the file) or
:class:`~lmdbstore.errors.ValidationError` (readable, but the data is unacceptable).
"""

from lmdbstore.ingestion.sources.base import CLASS_NAMES_KEY, Source
from lmdbstore.ingestion.sources.checks import Label
from lmdbstore.ingestion.sources.directory import DirectoryClassSource
from lmdbstore.ingestion.sources.h5 import H5Source
from lmdbstore.ingestion.sources.npy import NpySource
from lmdbstore.ingestion.sources.npz import NpzSource
from lmdbstore.ingestion.sources.opening import open_source, open_sources
from lmdbstore.ingestion.sources.scan import infer_classes, scan_source
from lmdbstore.ingestion.sources.tfrecord import TFRecordSource

__all__ = [
    "CLASS_NAMES_KEY",
    "DirectoryClassSource",
    "H5Source",
    "Label",
    "NpySource",
    "NpzSource",
    "Source",
    "TFRecordSource",
    "infer_classes",
    "open_source",
    "open_sources",
    "scan_source",
]
