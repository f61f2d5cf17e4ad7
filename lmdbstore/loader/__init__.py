"""Feeding a store to PyTorch: the batch-level dataset (``dataset``), the epoch orders (``samplers``: random,
block, balanced, DDP shares; ``window``: stores bigger than RAM; ``orders``: the pieces both build on) and the
reusable shared-memory batch buffers between DataLoader workers and the trainer (``buffers``), copied when a
batch leaves the process (``sharing``).
"""
