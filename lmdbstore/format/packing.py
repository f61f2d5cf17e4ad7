"""How many samples one LMDB value packs: the choice that wastes the least of LMDB's overflow pages."""

from __future__ import annotations

import math

from lmdbstore.format.limits import DEFAULT_MAX_VALUE_BYTES, LMDB_PAGE_SIZE

__all__ = ["choose_samples_per_value"]


def _value_cost(value_bytes: int, page_size: int) -> int:
    """Approximate bytes of LMDB pages one value of ``value_bytes`` occupies (8-byte keys)."""
    node_overhead = 8 + 8 + 2  # node header, key, slot pointer in the leaf page
    inline_max = (page_size - 16) // 2 - node_overhead
    if value_bytes <= inline_max:
        return value_bytes + node_overhead
    pages = math.ceil((value_bytes + 16) / page_size)  # 16-byte header on the first overflow page
    return pages * page_size + node_overhead + 4


def choose_samples_per_value(
    sample_bytes: int,
    trailer_bytes: int = 4,
    page_size: int = LMDB_PAGE_SIZE,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    tolerance: float = 1.005,
) -> int:
    """How many consecutive samples to pack into one value.

    A value larger than about half a page lives in overflow pages, and LMDB rounds it up to whole
    pages: one 2,500-byte sample per key costs 4,096 bytes (1.65x).  We pick the smallest count whose
    estimated page cost is within ``tolerance`` of the raw payload, or, if none is, the count with the
    least overhead, never making a value larger than ``max_value_bytes`` (unless one sample is larger).
    For 25x25 float32 with a crc32 trailer this is 18 samples in 11 pages (1.002x).
    """
    if sample_bytes < 1:
        raise ValueError(f"sample_bytes must be positive, got {sample_bytes}")
    upper = max(1, (max_value_bytes - trailer_bytes) // sample_bytes)
    best, best_ratio = 1, math.inf
    for spv in range(1, upper + 1):
        payload = spv * sample_bytes
        ratio = _value_cost(payload + trailer_bytes, page_size) / payload
        if ratio <= tolerance:
            return spv
        if ratio < best_ratio - 1e-12:
            best, best_ratio = spv, ratio
    return best
