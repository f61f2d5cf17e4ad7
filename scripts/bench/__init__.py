"""The benchmarks, one module each, run as ``python scripts/bench/<name>.py`` (``--quick`` for a smoke test):

* ``storage``   lmdbstore against memmap, naive LMDB, HDF5, SQLite and per-sample ``.npy`` files
* ``scaling``   lmdbstore stores of growing size, each read in a fresh process, against a memmap of that size
* ``loader``    the real DataLoader and trainer against a numpy memmap baseline
* ``ooc``       out-of-core reads against the disk's own random-read limits
* ``parallel``  ``write_parallel``'s producer scaling, and the single writer against ``np.save``
* ``peers``     lmdbstore beside MosaicML streaming, litdata and webdataset

Shared, not benchmarks: ``common`` (progress lines, tables and files, data and the store builder, timing,
goals) and ``machine`` (host facts, the page cache, the machine's own limits: memmap copy and ``pread`` rates).
Adapters: ``formats`` and ``other_formats`` (storage formats), ``peer_formats`` (the peer libraries).  A
benchmark too large for one module keeps its parts beside it: ``storage_report``, ``loader_runs`` and
``loader_report``, ``ooc_runs``.  No benchmark imports another; tests import them as ``bench.<name>``.
"""
