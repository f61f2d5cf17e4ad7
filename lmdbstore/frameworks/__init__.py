"""Feeding a store to Keras (any backend) and TensorFlow without torch: reader processes that read whole
batches into shared memory (``readers``, ``slots``), passes over a sampler's batches (``feed``), a
``keras.utils.PyDataset`` (``keras_data``: :func:`lmdbstore.keras_dataset`) and a ``tf.data.Dataset``
factory (``tf_data``: :func:`lmdbstore.tf_dataset`).
"""
