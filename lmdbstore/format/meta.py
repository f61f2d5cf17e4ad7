"""The JSON metadata record of a store (:class:`StoreMeta`; never pickled, parsed strictly: anything unexpected is a
one-line :class:`~lmdbstore.errors.CorruptStoreError` before any value sizes an allocation), and the rules for class
names.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from lmdbstore.errors import CorruptStoreError, FormatVersionError, preview
from lmdbstore.format.checksums import CHECKSUM_KINDS, checksum_size
from lmdbstore.format.dtypes import ALLOWED_DTYPES, label_dtype_for
from lmdbstore.format.layout import FORMAT_NAME, FORMAT_VERSION
from lmdbstore.format.limits import DEFAULT_LABEL_CHUNK, MAX_CLASSES, MAX_COUNT, MAX_DIM, MAX_NDIM, MAX_SAMPLE_BYTES
from lmdbstore.format.value_stats import ValueStats

__all__ = ["STORE_ID_HEX", "StoreMeta", "check_classes", "controlled_name", "new_store_id"]

#: Hex digits of a store id (128 random bits; see :attr:`StoreMeta.store_id`).
STORE_ID_HEX = 32
_STORE_ID = re.compile(f"[0-9a-f]{{{STORE_ID_HEX}}}")


def new_store_id() -> str:
    """A fresh random store id: 128 bits as 32 lowercase hex digits."""
    return secrets.token_hex(STORE_ID_HEX // 2)


def controlled_name(names: Iterable[object]) -> str | None:
    """The first of ``names`` (``str``, or ``bytes`` read as latin-1) holding a control character (C0, DEL, C1), or
    ``None``: the one check of class names wherever they enter, made on the Python strings (numpy drops trailing
    NULs: ``"a\\0"`` would become ``"a"``; the others garble every message that shows the name)."""
    for name in names:
        text = name.decode("latin-1") if isinstance(name, bytes) else str(name)
        if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text):
            return text
    return None


def check_classes(classes: Sequence[object]) -> list[str]:
    """The class list of a new store as strings: 1..``MAX_CLASSES`` distinct names, none empty or blank, none holding
    a control character (:func:`controlled_name`).  Raises ``ValueError``: naming ``classes``, with at most a few of
    the offending names."""
    if isinstance(classes, (str, bytes)) or not 1 <= len(classes) <= MAX_CLASSES:
        got = repr(classes[:20]) if isinstance(classes, (str, bytes)) else f"{len(classes)} names"
        raise ValueError(f"classes must be a list of 1..{MAX_CLASSES} class names, got {got}")
    names = [str(c) for c in classes]
    blank = [i for i, c in enumerate(names) if not c.strip()]
    if blank:
        raise ValueError(
            f"classes must not hold empty or blank names; blank at position {preview(blank, total=len(blank))}"
        )
    controlled = controlled_name(classes)
    if controlled is not None:
        raise ValueError(f"classes must not hold control characters; {controlled[:60]!r} does")
    repeated = [c for c, k in Counter(names).items() if k > 1]
    if repeated:
        raise ValueError(f"classes must be distinct names; repeated: {preview(repeated, quote=True)}")
    return names


def _refuse_constant(name: str) -> Any:
    """``json.loads`` hook: ``NaN``/``Infinity`` are not JSON, and metadata never holds them."""
    raise ValueError(f"non-finite number {name} is not allowed")


@dataclass
class StoreMeta:
    """The JSON metadata record of a store (sub-database ``meta``, key ``meta``; docs/FORMAT.md lists the fields).

    ``count`` and ``class_counts`` are rewritten in the transaction of the samples they describe.  ``store_id``: a
    random id written at creation (and anew for a copy), which tells a store replaced at the same path from the one a
    reader opened (``""``, left out of the JSON: a store written before it existed).
    """

    shape: tuple[int, ...]
    dtype: str
    classes: list[str]
    samples_per_value: int
    checksum: str = "crc32"
    count: int = 0
    class_counts: list[int] = field(default_factory=list)
    label_chunk: int = DEFAULT_LABEL_CHUNK
    created_by: str = ""
    created_at: str = ""
    updated_at: str = ""
    value_stats: ValueStats = field(default_factory=ValueStats)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    store_id: str = ""

    def __post_init__(self) -> None:
        if not self.class_counts:
            self.class_counts = [0] * len(self.classes)

    # ----- derived -----
    @property
    def np_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.dtype)

    @property
    def sample_bytes(self) -> int:
        return math.prod(self.shape) * self.np_dtype.itemsize  # math.prod: ~50x cheaper than np.prod per call

    @property
    def value_bytes(self) -> int:
        """Payload bytes of a full value (without the checksum trailer)."""
        return self.samples_per_value * self.sample_bytes

    @property
    def trailer_bytes(self) -> int:
        return checksum_size(self.checksum)

    @property
    def label_dtype(self) -> np.dtype[Any]:
        return label_dtype_for(len(self.classes))

    @property
    def n_values(self) -> int:
        return -(-self.count // self.samples_per_value)

    def expected_value_len(self, first: int) -> int:
        """Length in bytes (with trailer) the value starting at sample ``first`` must have."""
        n = min(self.samples_per_value, self.count - first)
        return n * self.sample_bytes + self.trailer_bytes

    def identity(self) -> tuple[Any, ...]:
        """What stays the same for as long as a store is the same store: its id (``""`` for stores written
        before ids existed), creation time and layout; only ``count`` and what follows from it grow."""
        return (
            self.store_id,
            self.created_at,
            self.shape,
            self.dtype,
            self.samples_per_value,
            self.checksum,
            tuple(self.classes),
            self.label_chunk,
        )

    def with_(self, **changes: Any) -> StoreMeta:
        return replace(self, **changes)

    # ----- JSON -----
    def to_json(self) -> bytes:
        d = asdict(self)
        d["shape"] = list(self.shape)
        if not self.store_id:
            del d["store_id"]
        return json.dumps(d, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview, path: str | None = None) -> StoreMeta:
        """Parse and validate metadata; anything unexpected raises ``CorruptStoreError``.

        Raises:
            FormatVersionError: a format version this code does not know.
            CorruptStoreError: malformed JSON, missing fields, or out-of-range values.
        """
        try:
            d = json.loads(bytes(raw).decode("utf-8"), parse_constant=_refuse_constant)
        except ValueError as exc:  # also UnicodeDecodeError, JSONDecodeError
            raise CorruptStoreError(f"metadata is not valid JSON ({exc})", path=path) from exc
        if not isinstance(d, dict):
            raise CorruptStoreError("metadata is not a JSON object", path=path)
        if d.get("format") != FORMAT_NAME:
            raise CorruptStoreError(f"metadata format is {d.get('format')!r}, expected {FORMAT_NAME!r}", path=path)
        version = d.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:  # not 1.0 nor true
            raise FormatVersionError(
                f"unsupported format version {version!r} (this lmdbstore reads version {FORMAT_VERSION})",
                path=path,
                hint="upgrade lmdbstore" if isinstance(version, int) and version > FORMAT_VERSION else None,
            )
        try:
            return cls._validated(d, path)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptStoreError(f"malformed metadata ({exc!r})", path=path) from exc

    @classmethod
    def _validated(cls, d: dict[str, Any], path: str | None) -> StoreMeta:
        def bad(msg: str) -> CorruptStoreError:
            return CorruptStoreError(f"malformed metadata: {msg}", path=path)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        shape = d["shape"]
        if not isinstance(shape, list) or not 1 <= len(shape) <= MAX_NDIM:
            raise bad(f"shape must be a list of 1..{MAX_NDIM} dimensions, got {shape!r}")
        if not all(is_int(s) and 1 <= s <= MAX_DIM for s in shape):
            raise bad(f"shape dimensions must be integers in 1..{MAX_DIM}, got {shape!r}")
        dtype = d["dtype"]
        if dtype not in ALLOWED_DTYPES:
            raise bad(f"dtype {dtype!r} is not one of {', '.join(ALLOWED_DTYPES)}")
        sample_bytes = math.prod(shape) * np.dtype(dtype).itemsize
        if sample_bytes > MAX_SAMPLE_BYTES:
            raise bad(f"sample of {sample_bytes} bytes exceeds {MAX_SAMPLE_BYTES}")
        classes = d["classes"]
        if (
            not isinstance(classes, list)
            or not 1 <= len(classes) <= MAX_CLASSES
            or not all(isinstance(c, str) for c in classes)
            or len(set(classes)) != len(classes)
        ):
            raise bad("classes must be a non-empty list of distinct strings")
        count = d["count"]
        if not is_int(count) or not 0 <= count <= MAX_COUNT:
            raise bad(f"count {count!r} out of range")
        counts = d["class_counts"]
        if (
            not isinstance(counts, list)
            or len(counts) != len(classes)
            or not all(is_int(c) and c >= 0 for c in counts)
            or sum(counts) != count
        ):
            raise bad("class_counts must hold one non-negative count per class summing to count")
        spv = d["samples_per_value"]
        if not is_int(spv) or not 1 <= spv <= 1 << 20:
            raise bad(f"samples_per_value {spv!r} out of range")
        if d["checksum"] not in CHECKSUM_KINDS:
            raise bad(f"checksum {d['checksum']!r} unknown")
        chunk = d["label_chunk"]
        if not is_int(chunk) or not 1 <= chunk <= 1 << 24:
            raise bad(f"label_chunk {chunk!r} out of range")
        vs = d.get("value_stats") or {}
        if not isinstance(vs, dict):
            raise bad("value_stats must be an object")
        fields = ("n", "sum", "sumsq", "min", "max", "nonfinite", "scale")
        try:
            stats = ValueStats(**{k: vs[k] for k in fields if k in vs}).validated()
        except ValueError as exc:
            raise bad(str(exc)) from None
        store_id = d.get("store_id", "")
        if not isinstance(store_id, str) or (store_id and not _STORE_ID.fullmatch(store_id)):
            raise bad(f"store_id must be {STORE_ID_HEX} lowercase hex digits, got {str(store_id)[:40]!r}")
        return cls(
            shape=tuple(shape),
            dtype=dtype,
            classes=list(classes),
            samples_per_value=spv,
            checksum=d["checksum"],
            count=count,
            class_counts=list(counts),
            label_chunk=chunk,
            created_by=str(d.get("created_by", "")),
            created_at=str(d.get("created_at", "")),
            updated_at=str(d.get("updated_at", "")),
            value_stats=stats,
            store_id=store_id,
        )
