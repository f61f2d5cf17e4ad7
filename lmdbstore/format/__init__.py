"""The on-disk format, in one place: sub-database names and key encodings, the dtype and checksum tables,
limits, the JSON metadata, value statistics, and a read-only parser of LMDB's pages (``pages``) and B-trees
(``btree``).

Nothing here opens an environment or writes a file; the store, the tools and the loader all read these
tables, so they cannot disagree about a byte.
"""
