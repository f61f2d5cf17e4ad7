"""The benchmarks, one module each, run as ``python scripts/bench/<name>.py`` (``--quick`` for a smoke test):

* ``storage``   lmdbstore against memmap, naive LMDB, HDF5, SQLite and per-sample ``.npy`` files
* ``scaling``   lmdbstore stores of growing size, each read in a fresh process, against a memmap of that size
* ``loader``    the real DataLoader and trainer against a numpy memmap baseline
* ``ooc``       out-of-core reads against the disk's own random-read limits
* ``parallel``  ``write_parallel``'s producer scaling, and the single writer against ``np.save``
* ``peers``     lmdbstore beside MosaicML streaming, litdata and webdataset

Shared, not benchmarks: ``common`` (progress lines, tables, data, timing, goals), ``machine`` (host facts, the
page cache, the machine's own limits), ``formats`` and ``other_formats`` (the storage-format adapters),
``storage_report`` (the storage benchmark's rows and report).  No benchmark imports another.
"""
