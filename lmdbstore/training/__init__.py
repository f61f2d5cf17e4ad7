"""The trainer behind ``lmdbstore train``/``eval`` (imports torch): :mod:`~lmdbstore.training.trainer` (``train``),
its inputs and orders (``data``), the epoch loop (``loop``), scoring (``evaluate``), resuming (``resume``),
metrics and output files (``metrics``), batches onto the device (``batches``), the CNN (``model``),
checkpoints (``checkpoint``) and the ``torchrun`` setup (``distributed``).
"""
