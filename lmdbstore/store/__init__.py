"""A store on disk, one module per concern (import from the defining module; this package exports nothing):

* ``env``: what a store directory is, opening its LMDB environment, read transactions, the metadata;
* ``registry``: one environment per store path and process (``ENVS``), shared by readers and the writer;
* ``locks``: the writer-lock protocol (the writer's exclusive lock, ``verify``'s shared one, the probe);
* ``opening``: ``open_writer``, which creates a store when needed; ``writer``: ``StoreWriter``'s appends and
  commits; ``tail``: the partly filled last pieces a commit rewrites; ``validation``: the checks applied to
  everything written;
* ``reader``: ``StoreReader``; ``handle``: its per-process open state (one snapshot); ``snapshot``: the rule
  saying when a snapshot's pages may be trusted; ``batch``: reading one batch; ``positions``: the position
  table of a snapshot, filled as batches need it, and its checks; ``fileread``: reads by file offset (the compiled
  ``batchread.c``) and the guard of liblmdb's reads; ``labels``: the label table and the per-class index lists.
"""
