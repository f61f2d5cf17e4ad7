"""The sample dtypes a store may declare (stored as raw little-endian bytes), each with the name of the torch dtype
the loader hands out (this module never imports torch), and the label dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ALLOWED_DTYPES", "DTYPES", "label_dtype_for", "normalize_dtype"]

#: Sample dtype a store may declare (always little-endian) -> the torch dtype's name.
DTYPES: dict[str, str] = {
    **{"<f2": "float16", "<f4": "float32", "<f8": "float64"},
    **{"|u1": "uint8", "<u2": "uint16", "<u4": "uint32", "<u8": "uint64"},
    **{"|i1": "int8", "<i2": "int16", "<i4": "int32", "<i8": "int64"},
}
#: Sample dtypes a store may declare (always stored little-endian).
ALLOWED_DTYPES = tuple(DTYPES)


def normalize_dtype(dtype: Any) -> str:
    """The little-endian dtype string a store declares for ``dtype`` (``float32`` -> ``'<f4'``). Raises
    ``ValueError``: ``dtype`` is not one a store may hold (see :data:`ALLOWED_DTYPES`)."""
    try:
        dt = np.dtype(dtype).newbyteorder("<")
    except TypeError as exc:
        raise ValueError(f"dtype {dtype!r} is not a numpy dtype") from exc
    if dt.str not in DTYPES:
        raise ValueError(f"dtype {dt} is not supported; use one of {', '.join(ALLOWED_DTYPES)}")
    return dt.str


def label_dtype_for(n_classes: int) -> np.dtype[Any]:
    """uint8 labels for up to 256 classes (50 MB for 50M samples), uint16 above."""
    return np.dtype("|u1") if n_classes <= 256 else np.dtype("<u2")
