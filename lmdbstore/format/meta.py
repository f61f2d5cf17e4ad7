"""The on-disk format: sub-database names, key encoding, value layout and the JSON metadata schema.

See ``docs/FORMAT.md`` for the prose description.  Everything that decides how bytes are laid out
lives here, so the writer, the reader and ``verify`` cannot disagree.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from lmdbstore.config import DEFAULT_LABEL_CHUNK, DEFAULT_MAX_VALUE_BYTES, DEFAULT_PAGE_SIZE
from lmdbstore.errors import CorruptStoreError, FormatVersionError, LmdbStoreError, preview

__all__ = [
    "ALLOWED_DTYPES",
    "DB_CLASSIDX",
    "DB_LABELS",
    "DB_META",
    "DB_PROGRESS",
    "DB_SAMPLES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "META_KEY",
    "MAX_CLASSES",
    "MAX_CLASS_NAME_CHARS",
    "StoreMeta",
    "ValueStats",
    "check_classes",
    "checksum_size",
    "choose_samples_per_value",
    "classidx_key",
    "compute_checksum",
    "decode_key",
    "encode_key",
    "json_safe",
    "label_dtype_for",
]

FORMAT_NAME = "lmdbstore"
FORMAT_VERSION = 1

DB_SAMPLES = b"samples"
DB_LABELS = b"labels"
DB_CLASSIDX = b"classidx"
DB_META = b"meta"
DB_PROGRESS = b"progress"
META_KEY = b"meta"
MAX_DBS = 8

MAX_CLASSES = 65535
#: Longest class name a file's ``class_names`` member may hold (checked from its header before reading it).
MAX_CLASS_NAME_CHARS = 256
MAX_NDIM = 4
MAX_DIM = 1 << 16
MAX_SAMPLE_BYTES = 64 * 1024 * 1024
MAX_COUNT = 1 << 48

#: Sample dtypes a store may declare (always stored little-endian).
ALLOWED_DTYPES = ("<f2", "<f4", "<f8", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<i8", "<u8")

_KEY = struct.Struct(">Q")
_CLASSIDX_KEY = struct.Struct(">HQ")
#: Per-class index lists are stored as little-endian uint64.
INDEX_DTYPE = np.dtype("<u8")


def encode_key(index: int) -> bytes:
    """Fixed-width big-endian key, so LMDB's byte order is index order (and ``append=True`` works)."""
    return _KEY.pack(index)


def decode_key(key: bytes) -> int:
    """Inverse of :func:`encode_key`; raises ``CorruptStoreError`` for a key of the wrong width."""
    if len(key) != _KEY.size:
        raise CorruptStoreError(f"key of {len(key)} bytes, expected {_KEY.size}", key=key.hex())
    return int(_KEY.unpack(key)[0])


def classidx_key(class_id: int, position: int) -> bytes:
    """Key of the chunk of class ``class_id``'s index list that starts at ``position`` in that list."""
    return _CLASSIDX_KEY.pack(class_id, position)


def label_dtype_for(n_classes: int) -> np.dtype[Any]:
    """uint8 labels for up to 256 classes (50 MB for 50M samples), uint16 above."""
    return np.dtype("|u1") if n_classes <= 256 else np.dtype("<u2")


def check_classes(classes: Sequence[object]) -> list[str]:
    """The class list of a new store as strings: 1..``MAX_CLASSES`` distinct names, none empty or blank.

    Raises:
        ValueError: naming ``classes``, with at most a few of the offending names.
    """
    if isinstance(classes, (str, bytes)) or not 1 <= len(classes) <= MAX_CLASSES:
        got = repr(classes[:20]) if isinstance(classes, (str, bytes)) else f"{len(classes)} names"
        raise ValueError(f"classes must be a list of 1..{MAX_CLASSES} class names, got {got}")
    names = [str(c) for c in classes]
    blank = [i for i, c in enumerate(names) if not c.strip()]
    if blank:
        raise ValueError(
            f"classes must not hold empty or blank names; blank at position {preview(blank, total=len(blank))}"
        )
    repeated = [c for c, k in Counter(names).items() if k > 1]
    if repeated:
        raise ValueError(f"classes must be distinct names; repeated: {preview(repeated, quote=True)}")
    return names


def checksum_size(kind: str) -> int:
    """Bytes of the checksum trailer appended to every value for checksum ``kind``."""
    return {"none": 0, "crc32": 4, "xxh64": 8}[kind]


def _xxh64(data: bytes | memoryview) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise LmdbStoreError(
            "this store uses xxh64 checksums but the xxhash package is not installed",
            hint="pip install 'lmdbstore[xxhash]'",
        ) from exc
    return bytes(xxhash.xxh64_digest(data)[::-1])  # little-endian like crc32


def _crc32(data: bytes | memoryview) -> bytes:
    return struct.pack("<I", zlib.crc32(data))


def compute_checksum(kind: str) -> Callable[[bytes | memoryview], bytes] | None:
    """The function that computes the trailer for checksum ``kind``, or ``None`` for ``"none"``."""
    if kind == "none":
        return None
    if kind == "crc32":
        return _crc32
    if kind == "xxh64":
        return _xxh64
    raise ValueError(f"unknown checksum kind {kind!r}")


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
    page_size: int = DEFAULT_PAGE_SIZE,
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


#: Largest magnitude a value may have after scaling by ``2**-scale``: its square (about 2**900) summed
#: over far more values than any store holds stays below float64's largest finite number (2**1024).
_STATS_MAX_SCALED_EXP = 450
#: ``scale`` a store's metadata may claim (finite float64 values lie below 2**1024).
MAX_STATS_SCALE = 1100


@dataclass
class ValueStats:
    """Exact running statistics of every value ingested (float64 accumulators).

    ``sum`` and ``sumsq`` are kept for the values divided by ``2**scale`` (``scale`` 0 unless values beyond
    about 1e135 arrived), so the sum of squares of values up to float64's largest stays finite; powers of
    two rescale exactly.  ``mean``/``std`` undo the scaling.
    """

    n: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    min: float | None = None
    max: float | None = None
    nonfinite: int = 0
    scale: int = 0

    #: Elements folded in per step: float64 temporaries of 2 MiB stay in cache instead of a fresh
    #: allocation the size of a whole commit (page faults cost more than the arithmetic).
    CHUNK = 1 << 18

    def update(self, x: np.ndarray) -> None:
        """Fold a batch of samples in; non-finite values are counted and left out of the moments."""
        flat = np.asarray(x).reshape(-1)
        for lo in range(0, flat.size, self.CHUNK):
            self._update_chunk(flat[lo : lo + self.CHUNK])

    def _rescale(self, scale: int) -> None:
        """Switch to a larger ``scale`` (exact: powers of two)."""
        if scale > self.scale:
            shift = scale - self.scale
            self.sum, self.sumsq = math.ldexp(self.sum, -shift), math.ldexp(self.sumsq, -2 * shift)
            self.scale = scale

    def _update_chunk(self, flat: np.ndarray) -> None:
        if flat.dtype.kind == "f":
            finite_mask = np.isfinite(flat)
            n_bad = int(flat.size - np.count_nonzero(finite_mask))
            if n_bad:
                self.nonfinite += n_bad
                flat = flat[finite_mask]
            if flat.size == 0:
                return
        f64 = flat.astype(np.float64)
        lo, hi = float(f64.min()), float(f64.max())
        peak = max(abs(lo), abs(hi))
        if peak > 0:
            self._rescale(math.frexp(peak)[1] - _STATS_MAX_SCALED_EXP)
        if self.scale:
            f64 = np.ldexp(f64, -self.scale)
        self.n += int(f64.size)
        self.sum += float(f64.sum())
        self.sumsq += float(np.einsum("i,i->", f64, f64))  # not np.dot: BLAS threads stall on a busy machine
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)

    def merge(self, other: ValueStats) -> None:
        """Fold in statistics computed elsewhere (e.g. in a worker process) over other values."""
        other = replace(other)
        self._rescale(other.scale)
        other._rescale(self.scale)
        self.n, self.sum, self.sumsq = self.n + other.n, self.sum + other.sum, self.sumsq + other.sumsq
        self.nonfinite += other.nonfinite
        self.min = other.min if self.min is None else self.min if other.min is None else min(self.min, other.min)
        self.max = other.max if self.max is None else self.max if other.max is None else max(self.max, other.max)

    def _unscaled(self, v: float) -> float | None:
        try:
            return math.ldexp(v, self.scale)
        except OverflowError:  # only tampered metadata gets here: the writer keeps it in range
            return None

    @property
    def mean(self) -> float | None:
        return self._unscaled(self.sum / self.n) if self.n else None

    @property
    def std(self) -> float | None:
        if not self.n:
            return None
        mean = self.sum / self.n
        return self._unscaled(math.sqrt(max(self.sumsq / self.n - mean * mean, 0.0)))

    def validated(self) -> ValueStats:
        """These statistics with finite float moments, or ``ValueError`` saying which field is bad."""
        ints = {"n": self.n, "nonfinite": self.nonfinite, "scale": self.scale}
        for name, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"value_stats {name} must be an integer")
        if not (0 <= self.n <= 1 << 63 and 0 <= self.nonfinite <= 1 << 63):
            raise ValueError("value_stats counts must be non-negative integers below 2**63")
        if not 0 <= self.scale <= MAX_STATS_SCALE:
            raise ValueError(f"value_stats scale must be in 0..{MAX_STATS_SCALE}")
        floats: dict[str, float | None] = {}
        for name in ("sum", "sumsq", "min", "max"):
            v = getattr(self, name)
            if v is None and name in ("min", "max"):
                floats[name] = None
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"value_stats {name} must be a number{' or null' if name in ('min', 'max') else ''}")
            try:
                f = float(v)
            except OverflowError:
                raise ValueError(f"value_stats {name} is out of float64 range") from None
            if not math.isfinite(f):
                raise ValueError(f"value_stats {name} must be finite")
            floats[name] = f
        if (floats["sumsq"] or 0.0) < 0:
            raise ValueError("value_stats sumsq must not be negative")
        out = ValueStats(self.n, floats["sum"] or 0.0, floats["sumsq"] or 0.0, floats["min"], floats["max"])
        out.nonfinite, out.scale = self.nonfinite, self.scale
        if out.n and (out.mean is None or out.std is None):
            raise ValueError("value_stats sum/sumsq/scale give a mean or std beyond float64 range")
        return out


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by ``None``, so it dumps as valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _refuse_constant(name: str) -> Any:
    """``json.loads`` hook: ``NaN``/``Infinity`` are not JSON, and metadata never holds them."""
    raise ValueError(f"non-finite number {name} is not allowed")


@dataclass
class StoreMeta:
    """The JSON metadata record of a store (sub-database ``meta``, key ``meta``).

    ``count`` and ``class_counts`` are rewritten in the same transaction as the samples they describe,
    so after any crash they agree with what is committed.
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

    def __post_init__(self) -> None:
        if not self.class_counts:
            self.class_counts = [0] * len(self.classes)

    # ----- derived -----
    @property
    def np_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.dtype)

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.np_dtype.itemsize

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

    def value_key(self, index: int) -> int:
        """Index of the first sample of the value holding sample ``index``."""
        return index - index % self.samples_per_value

    def expected_value_len(self, first: int) -> int:
        """Length in bytes (with trailer) the value starting at sample ``first`` must have."""
        n = min(self.samples_per_value, self.count - first)
        return n * self.sample_bytes + self.trailer_bytes

    def with_(self, **changes: Any) -> StoreMeta:
        return replace(self, **changes)

    # ----- JSON -----
    def to_json(self) -> bytes:
        d = asdict(self)
        d["shape"] = list(self.shape)
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
        if d["checksum"] not in ("none", "crc32", "xxh64"):
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
        )
