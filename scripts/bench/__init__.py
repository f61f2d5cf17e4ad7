"""The benchmark harness: every benchmark declared as data (:mod:`.suites`), run by one driver (:mod:`.driver`).

Run one with ``python -m scripts.bench NAME [--quick]`` from the repository root (``list`` names them; ``report``
writes docs/benchmarks.md and the README's headline table from the results).  Modules:

* ``spec``      what a benchmark is: its data, rows, baselines and goals (dataclasses, nothing runs);
* ``suites``    every benchmark, declared;
* ``driver``    the one driver: extras and disk checked first, artifacts built or reused, interleaved rounds,
                bracketing limits, results written row by row;
* ``machine``   the machine's header, its page cache, its own limits (``pread``, sequential read and write);
* ``data``      the samples, and the store, set and ``.npy`` built from them;
* ``measures``  the read measurements (``read_batch``, memmap, ``make_loader``, the feed under each framework);
* ``formats``   the other formats and the peer libraries: built, and read their own way;
* ``jobs``      whole jobs: verify, writing, TFRecord ingest, samplers' memory, training, the demo, the GPU;
* ``report``    results as Markdown: a benchmark's section, docs/benchmarks.md, the README's headline table.

Measurements use the library's public API and its CLI only.
"""
