"""The feed: the one mechanism that reads a store's batches in reader processes and hands them to a training
loop, under every adapter (``make_loader`` for PyTorch, ``keras_dataset``, ``tf_dataset``).

numpy only: torch appears in the PyTorch adapter (:mod:`lmdbstore.frameworks.torch_data`) and its CUDA helper.
"""
