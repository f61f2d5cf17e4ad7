"""A built-in, learnable 5-class dataset of z-scored 25x25 float32 arrays (the reference case): each class a noisy
spatial pattern with random position, scale and phase (a small CNN learns it), generated in batches.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from numpy.lib import format as npformat

from lmdbstore.config import DEFAULT_SYNTH_SEED
from lmdbstore.util.atomic import atomic_paths
from lmdbstore.util.paths import check_output_file, write_errors

__all__ = ["SYNTH_CLASSES", "SYNTH_SHAPE", "synth_batches", "write_synth_npz"]

SYNTH_CLASSES = ("blob", "ring", "hstripes", "vstripes", "checker")
SYNTH_SHAPE = (25, 25)
DEFAULT_NOISE = 1.0


def _patterns(labels: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    n = len(labels)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    yy, xx = yy[None], xx[None]
    cy = rng.uniform(6, size - 6, (n, 1, 1)).astype(np.float32)
    cx = rng.uniform(6, size - 6, (n, 1, 1)).astype(np.float32)
    scale = rng.uniform(2.0, 4.0, (n, 1, 1)).astype(np.float32)
    freq = rng.uniform(0.5, 0.9, (n, 1, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, (n, 1, 1)).astype(np.float32)
    out = np.empty((n, size, size), np.float32)
    for c in range(len(SYNTH_CLASSES)):
        m = labels == c
        if not m.any():
            continue
        if c in (0, 1):
            r2 = (yy - cy[m]) ** 2 + (xx - cx[m]) ** 2
            if c == 0:
                out[m] = np.exp(-r2 / (2 * scale[m] ** 2))
            else:
                out[m] = np.exp(-((np.sqrt(r2) - 2.2 * scale[m]) ** 2) / 2.0)
        elif c == 2:
            out[m] = 0.5 * np.sin(freq[m] * yy + phase[m])
        elif c == 3:
            out[m] = 0.5 * np.sin(freq[m] * xx + phase[m])
        else:
            out[m] = 0.5 * np.sin(freq[m] * xx + phase[m]) * np.sin(freq[m] * yy + phase[m])
    return out


def synth_batches(
    n: int, *, seed: int = DEFAULT_SYNTH_SEED, batch: int = 65536, noise: float = DEFAULT_NOISE
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(x, y)`` batches of the synthetic dataset: x float32 (b, 25, 25) z-scored, y int64.

    Labels are drawn uniformly from the 5 classes.  The same ``(n, seed, batch)`` gives the same data.

    Raises:
        ValueError: ``n`` negative or ``batch`` not positive.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    rng = np.random.default_rng(seed)
    for lo in range(0, n, batch):
        b = min(batch, n - lo)
        y = rng.integers(0, len(SYNTH_CLASSES), b)
        x = _patterns(y, rng, SYNTH_SHAPE[0])
        x += noise * rng.standard_normal(x.shape, dtype=np.float32) * 0.5
        x -= x.mean(axis=(1, 2), keepdims=True)
        x /= x.std(axis=(1, 2), keepdims=True) + 1e-6
        yield x.astype(np.float32, copy=False), y.astype(np.int64)


def write_synth_npz(
    path: str | os.PathLike[str], n: int, *, seed: int = DEFAULT_SYNTH_SEED, noise: float = DEFAULT_NOISE
) -> None:
    """Write the synthetic dataset to an uncompressed ``.npz`` with arrays ``x``, ``y`` and ``class_names``.

    The archive is written member by member in batches (``np.savez`` would need all of ``x`` in memory).
    """
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    check_output_file(path)
    with (
        write_errors(path, "write"),
        atomic_paths([Path(path)]) as (tmp,),
        zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf,
    ):
        labels = []  # 8 bytes per sample: small next to the samples, which are streamed
        with zf.open("x.npy", "w", force_zip64=True) as fx:
            header = {"descr": "<f4", "fortran_order": False, "shape": (n, *SYNTH_SHAPE)}
            npformat.write_array_header_1_0(fx, header)
            for x, y in synth_batches(n, seed=seed, noise=noise):
                fx.write(x.tobytes())
                labels.append(y.astype("<i8"))
        for name, arr in (("y.npy", np.concatenate(labels)), ("class_names.npy", np.array(SYNTH_CLASSES))):
            with zf.open(name, "w", force_zip64=True) as fp:
                npformat.write_array(fp, arr, allow_pickle=False)
