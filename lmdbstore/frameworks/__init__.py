"""The adapters of the feed (:mod:`lmdbstore.feed`) to each framework: PyTorch (``torch_data``:
:class:`~lmdbstore.frameworks.torch_data.LmdbBatchDataset`, :func:`lmdbstore.make_loader`; ``cuda``: page-locked
slots and device staging), Keras (``keras_data``: :func:`lmdbstore.keras_dataset`) and TensorFlow (``tf_data``:
:func:`lmdbstore.tf_dataset`).  Each imports its own framework only.
"""
