"""The orders a feed reads in, numpy only: the epoch samplers (``samplers``: random, block, balanced, DDP shares;
``window``: stores bigger than RAM; ``orders`` and ``plans``: the pieces they build on), epochs and passes
(``passes``), per-store shares (``mixing``), sets of stores (``sets``), the choice among them (``choose``) and
the batch transform hook (``transform``).
"""
