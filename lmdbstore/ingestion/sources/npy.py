"""``.npy`` sources: one stack ``(N, *shape)`` whose samples all carry the ``label=`` class."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmdbstore.errors import SourceError, one_line
from lmdbstore.ingestion.sources.base import FileSource, const_labels
from lmdbstore.ingestion.sources.checks import Label, check_range, stat_file
from lmdbstore.ingestion.sources.npyio import check_size, check_stack, read_header, read_rows


class NpySource(FileSource):
    """A ``.npy`` stack ``(N, *shape)``, all samples labelled ``label``."""

    kind = "npy"

    def __init__(self, path: Path, *, label: Label | None) -> None:
        st = stat_file(path)
        if label is None:
            raise SourceError(
                "an .npy file holds no labels; say which class its samples belong to",
                path=path,
                hint="pass label=CLASS",
            )
        with open(path, "rb") as f:
            h = read_header(f, path)
        check_stack(h, path, "the array")
        check_size(h, st.st_size, path, "the array")
        self.path, self.name, self.label = path, str(path), label
        self.shape, self.dtype, self._n = h.shape[1:], h.dtype, h.shape[0]
        self._header, self._stat = h, st

    def _read(self, batch: int, start: int, with_x: bool) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
        check_range(batch, start, self._n)
        assert self.label is not None
        try:
            f = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
        except OSError as exc:
            raise SourceError(f"cannot open ({one_line(exc)})", path=self.path) from exc
        with f:
            for x in read_rows(f, self._header, self.path, "the array", batch, start):
                yield x, const_labels(self.label, len(x))
