"""A store on disk, one module per concern (import from the defining module; this package exports nothing):

* writing: ``opening`` (``open_writer``), ``writer`` (appends and commits), ``tail`` (the partial last pieces a
  commit rewrites), ``validation`` (the checks of what is written), ``locks`` (the writer-lock protocol);
* opening: ``env`` (store directories, environments, the metadata), ``registry`` (one environment per path and
  process);
* reading: ``reader`` (``StoreReader``, labels), ``multi`` (``StoreSet``), ``readers`` (one store or a set),
  ``metaview`` (what both share), ``pinned`` and ``handle`` (a reader's snapshots), ``snapshot`` (when one may be
  trusted), ``batch``, ``positions`` and ``fileread`` (a batch by file offset; ``batchread.c``).
"""
