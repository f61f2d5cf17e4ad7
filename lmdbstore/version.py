"""The one version string of lmdbstore (the package, its CLI and the ``writer_version`` of new stores)."""

__version__ = "0.1.0"
