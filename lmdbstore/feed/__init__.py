"""The feed: the one mechanism that reads a store's batches in reader processes and hands them to a training
loop, under every adapter (``make_loader`` for PyTorch, ``keras_dataset``, ``tf_dataset``).

``slots`` (shared-memory batch slots, how many fit), ``readers`` (the reader processes and what they read),
``seeding`` (each batch's generators), ``idle`` (readers that stop when nobody asks), ``layout`` (where the
channel axis goes), ``feed`` (passes, resume counts, fences) and ``opening`` (a feed as a
:class:`~lmdbstore.config.LoaderConfig` says).  numpy only: torch appears in the PyTorch adapter
(:mod:`lmdbstore.frameworks.torch_data`) and its CUDA helper.
"""
