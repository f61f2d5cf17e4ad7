"""JSON output that is always valid: non-finite floats become ``null``."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["json_safe"]


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by ``None``, so it dumps as valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
