"""Small helpers more than one subpackage needs (output paths, atomic writes and their leftovers,
progress bars, shared memory made private in a forked child); no store logic."""
