"""Getting samples into a store: sources (files, directories, other stores), the validate-then-write
ingest, many producer processes feeding one writer (``write_parallel``) and the built-in synthetic data.
"""
