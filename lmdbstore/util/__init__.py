"""Small helpers more than one subpackage needs (output paths, atomic writes, progress bars); no store logic."""
