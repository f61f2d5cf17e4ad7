"""Feeding a store to PyTorch: the batch-level dataset, the epoch orders (random, block, window, balanced,
DDP shards), and the reusable shared-memory batch buffers between DataLoader workers and the trainer.
"""
