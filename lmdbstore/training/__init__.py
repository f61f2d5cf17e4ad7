"""The trainer behind ``lmdbstore train``/``eval``: the loop, evaluation, the CNN, checkpoints and the
distributed (``torchrun``) setup.  Imports torch.
"""
