"""The reshard plan: which bytes go from which source rank to which destination ranks, in which bucket.

Every source rank describes the tensors it holds as boxes in the global tensor (name, dtype, global
shape, global offset, local shape): FSDP Shard(0) chunks, TP shards, or whole replicated tensors. Every
destination rank declares the boxes it needs (its inference TP layout). The plan is the N-d
intersections of those boxes, ordered deterministically and grouped into flattened buckets of at most
`bucket_bytes`. Every agent computes the same plan from the same inputs and compares `plan.hash` before
any byte moves (anchor: Awex transfer plan), so a disagreement is an error, not silent corruption.

Rules:
* A (name, rank) pair has at most one box, on both sides.
* Distinct source boxes of one tensor must be disjoint; identical boxes on several ranks are replicas
  (data parallelism): each box gets one owner, rotated over the replicas to spread the load.
* A piece that several destinations need byte-identically (same source box intersection) is sent once
  to all of them: a bucket has one source and one or more destinations (broadcast when more).
* Pieces bigger than a bucket are split along their leading dimensions.
* Pieces are ordered by (source, destinations, tensor name, offset); each (source, destinations) stream
  is packed into buckets in that order, and the buckets of all streams are interleaved round-robin.

Scale: a 70,000-tensor model on 256 FSDP ranks is 18M source shards and, to 2 TP ranks, 36M pieces.
So both sides are columnar (`ShardTable`: numpy arrays, not objects), the planner is vectorized (the
intersection of every source box with every destination box, chunked over source ranks), and the plan
stays columnar: `BucketPlan.entries` become objects only when an agent looks at a bucket of a rank it
serves. Lists of `TensorShard` still work everywhere (they are converted).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import itertools
import json
import math
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar, overload

import numpy as np
import torch

from .buckets import (
    DEFAULT_ALIGNMENT,
    SMALL_ALIGNMENT,
    BucketEntry,
    BucketLayout,
    align_up,
    dtype_name,
    entry_offset,
    itemsize,
    to_dtype,
)

PLAN_FORMAT = 2  # 2: columnar hash (1 hashed a text rendering of every piece)


class PlanError(ValueError):
    """Source and destination metadata cannot produce a plan (missing tensor, dtype/shape disagreement,
    overlapping sources, uncovered region). The message names the tensor and ranks involved."""


@dataclass(frozen=True, order=True)
class Box:
    """An axis-aligned region of a tensor: `shape` elements starting at `offset` (global coordinates)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise PlanError(f"box offset {self.offset} and shape {self.shape} have different ranks")
        if self.offset and (min(self.offset) < 0 or min(self.shape) < 0):
            raise PlanError(f"box offset {self.offset} / shape {self.shape} must be non-negative")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        shp = tuple(map(int, shape))
        return cls((0,) * len(shp), shp)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when it is empty."""
        if self.ndim != other.ndim:
            raise PlanError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end, strict=True))
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))

    def contains(self, other: Box) -> bool:
        return all(
            so <= oo and oe <= se
            for so, se, oo, oe in zip(self.offset, self.end, other.offset, other.end, strict=True)
        )

    def slices_within(self, outer: Box) -> tuple[slice, ...]:
        """Index `outer`'s local tensor with this to get this box (this box must lie inside `outer`)."""
        if not outer.contains(self):
            raise PlanError(f"box {self} is not inside {outer}")
        return tuple(slice(o - oo, o - oo + s) for o, oo, s in zip(self.offset, outer.offset, self.shape, strict=True))

    def split(self, max_numel: int) -> list[Box]:
        """Split into row-major consecutive sub-boxes of at most `max_numel` elements each."""
        if max_numel < 1:
            raise PlanError("cannot split a box into pieces of fewer than one element")
        if self.numel <= max_numel:
            return [self]
        # The first dim whose trailing block fits; every index of the dims before it is its own piece.
        d = 0
        while math.prod(self.shape[d + 1 :]) > max_numel:
            d += 1
        inner = math.prod(self.shape[d + 1 :])
        step = max(1, max_numel // inner)
        out: list[Box] = []

        def rec(prefix_off: tuple[int, ...], prefix_shape: tuple[int, ...], i: int) -> None:
            if i == d:
                for start in range(0, self.shape[d], step):
                    n = min(step, self.shape[d] - start)
                    out.append(
                        Box(
                            (*prefix_off, self.offset[d] + start, *self.offset[d + 1:]),
                            (*prefix_shape, n, *self.shape[d + 1:]),
                        )
                    )
                return
            for k in range(self.shape[i]):
                rec((*prefix_off, self.offset[i] + k), (*prefix_shape, 1), i + 1)

        rec((), (), 0)
        return out

    def to_list(self) -> list[list[int]]:
        return [list(self.offset), list(self.shape)]


@dataclass(frozen=True)
class TensorShard:
    """One box of one named tensor that a rank holds (source) or needs (destination)."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box

    def __post_init__(self) -> None:
        to_dtype(self.dtype)
        gs, box = self.global_shape, self.box
        if len(gs) != len(box.shape) or any(o + s > g for o, s, g in zip(box.offset, box.shape, gs, strict=True)) or (
                gs and min(gs) < 0):
            raise PlanError(
                f"tensor {self.name!r}: box offset={self.box.offset} shape={self.box.shape} "
                f"is outside its global shape {self.global_shape}"
            )

    @classmethod
    def full(cls, name: str, dtype: str | torch.dtype, shape: Sequence[int]) -> TensorShard:
        dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
        box = Box.full(shape)
        return cls(name, dt, box.shape, box)

    @classmethod
    def of(
        cls, name: str, dtype: str | torch.dtype, global_shape: Sequence[int], offset: Sequence[int], shape: Sequence[int]
    ) -> TensorShard:
        dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return cls(name, dt, tuple(int(s) for s in global_shape), Box(tuple(offset), tuple(shape)))

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "global_shape": list(self.global_shape),
                "offset": list(self.box.offset), "shape": list(self.box.shape)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorShard:
        return cls.of(d["name"], d["dtype"], d["global_shape"], d["offset"], d["shape"])


@dataclass(frozen=True)
class Piece:
    """A region moved as one unit: `box` of tensor `name`, read from source rank `src` (whose shard is
    `src_box`) and delivered to every rank in `dsts`."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    src: int
    src_box: Box
    dsts: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.dtype)

    def canonical(self) -> list[Any]:
        return [self.name, self.dtype, list(self.global_shape), self.box.to_list(), self.src,
                self.src_box.to_list(), list(self.dsts)]


@dataclass(frozen=True)
class PlannedEntry:
    """A piece at a byte offset of its bucket."""

    piece: Piece
    offset: int

    @property
    def bucket_entry(self) -> BucketEntry:
        return BucketEntry(self.piece.name, self.piece.dtype, self.piece.box.shape, self.offset)


def _hugepage_setter() -> Callable[[bool], bool] | None:
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        setter = getattr(mod, "_set_madvise_hugepage", None)
        if setter is not None:
            return setter
    return None


_SET_HUGEPAGE = _hugepage_setter()
_HP_LOCK = threading.Lock()
_HP_STATE = [0, True]  # nesting depth, setting to restore

F = TypeVar("F", bound=Callable[..., Any])


def _streamed(fn: F) -> F:
    """Run `fn` with numpy's transparent-huge-page advice off. Why: numpy madvises huge pages on large
    arrays, and under the common THP defrag=madvise setting the kernel then compacts memory on first
    touch: the arrays of a 70k x 256 plan (written once, streamed a few times) took 3x longer to build
    on a busy node. The setting is process-wide, so it is restored when the last such call returns."""
    if _SET_HUGEPAGE is None:
        return fn
    setter = _SET_HUGEPAGE

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _HP_LOCK:
            if _HP_STATE[0] == 0:
                _HP_STATE[1] = setter(False)
            _HP_STATE[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _HP_LOCK:
                _HP_STATE[0] -= 1
                if _HP_STATE[0] == 0:
                    setter(bool(_HP_STATE[1]))

    return run  # type: ignore[return-value]


_new = object.__new__


def _box(offset: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    """A Box from a table that was validated as a whole: skips the per-object checks (the objects of a
    rank of a large model are counted in hundreds of thousands)."""
    b = _new(Box)
    d = b.__dict__
    d["offset"] = offset
    d["shape"] = shape
    return b


def _shard(name: str, dtype: str, global_shape: tuple[int, ...], box: Box) -> TensorShard:
    s = _new(TensorShard)
    d = s.__dict__
    d["name"], d["dtype"], d["global_shape"], d["box"] = name, dtype, global_shape, box
    return s


def _rows(cols: np.ndarray, sel: Any) -> list[tuple[int, ...]]:
    """[dims, n] columns -> n tuples of Python ints."""
    return list(zip(*(c[sel].tolist() for c in cols), strict=True)) if len(cols) else []


@dataclass(frozen=True)
class BucketColumns:
    """A bucket's pieces as arrays, for code that must not make an object per piece (a destination of
    a 70k-tensor x 256-rank FSDP model receives 18M pieces). Boxes are [dims, pieces], padded with
    offset 0 / size 1 beyond a tensor's ndim[tensor] dims; names/dtypes/ndim are indexed by tensor id."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    ndim: np.ndarray
    tensor: np.ndarray
    offset: np.ndarray
    shape: np.ndarray
    src_offset: np.ndarray
    src_shape: np.ndarray
    entry_offset: np.ndarray


@dataclass(frozen=True)
class BucketPlan:
    """One flattened bucket: its pieces all come from `src` and all go to every rank in `dsts`."""

    index: int
    src: int
    dsts: tuple[int, ...]
    entries: Sequence[PlannedEntry]
    nbytes: int

    @property
    def broadcast(self) -> bool:
        """True when more than one destination needs these exact bytes."""
        return len(self.dsts) > 1

    @property
    def data_nbytes(self) -> int:
        """Bytes of the pieces themselves (the bucket less its alignment padding)."""
        if isinstance(self.entries, _Entries):
            return self.entries.data_nbytes
        return sum(e.piece.nbytes for e in self.entries)

    @cached_property
    def layout(self) -> BucketLayout:
        return BucketLayout(tuple(e.bucket_entry for e in self.entries), self.nbytes)

    def columns(self) -> BucketColumns:
        """The pieces as arrays (no objects made when the plan is columnar)."""
        if isinstance(self.entries, _Entries):
            return self.entries.columns()
        table = ShardTable.from_lists([[_shard(e.piece.name, e.piece.dtype, e.piece.global_shape, e.piece.box)
                                        for e in self.entries]])
        srcs = ShardTable.from_lists([[_shard(e.piece.name, e.piece.dtype, e.piece.global_shape, e.piece.src_box)
                                       for e in self.entries]])
        order = [table.index[e.piece.name] for e in self.entries]  # entry order, not name order
        return BucketColumns(table.names, table.dtypes, table.ndim, table.tensor[order], table.off[:, order],
                             table.shp[:, order], srcs.off[:, order], srcs.shp[:, order],
                             np.array([e.offset for e in self.entries], dtype=np.int64))


class _Entries(Sequence[PlannedEntry]):
    """A bucket's entries, made into objects on first use: the plan keeps its pieces as arrays and an
    agent only ever looks at the buckets of the ranks it serves."""

    __slots__ = ("_bucket", "_core", "_items")

    def __init__(self, core: _Core, bucket: int) -> None:
        self._core = core
        self._bucket = bucket
        self._items: tuple[PlannedEntry, ...] | None = None

    def _load(self) -> tuple[PlannedEntry, ...]:
        items = self._items
        if items is None:
            items = self._items = self._core.entries(self._bucket)
        return items

    def __len__(self) -> int:
        return int(self._core.b_hi[self._bucket] - self._core.b_lo[self._bucket])

    @overload
    def __getitem__(self, i: int) -> PlannedEntry: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PlannedEntry]: ...

    def __getitem__(self, i: int | slice) -> PlannedEntry | Sequence[PlannedEntry]:
        return self._load()[i]

    def __iter__(self) -> Iterator[PlannedEntry]:
        return iter(self._load())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self._load() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._load())

    def __repr__(self) -> str:
        return f"<{len(self)} entries of bucket {self._bucket}>"

    @property
    def data_nbytes(self) -> int:
        return int(self._core.b_data[self._bucket])

    def columns(self) -> BucketColumns:
        return self._core.columns(self._bucket)


class _Ranks(Sequence[tuple[TensorShard, ...]]):
    """`plan.sources` / `plan.needs`: rank r's shards sorted by name, made into objects when asked for."""

    __slots__ = ("table",)

    def __init__(self, table: ShardTable) -> None:
        self.table = table

    def __len__(self) -> int:
        return self.table.num_ranks

    @overload
    def __getitem__(self, i: int) -> tuple[TensorShard, ...]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[TensorShard, ...]]: ...

    def __getitem__(self, i: int | slice) -> tuple[TensorShard, ...] | Sequence[tuple[TensorShard, ...]]:
        if isinstance(i, slice):
            return tuple(self.table.shards(r) for r in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"rank {i} is outside 0..{n - 1}")
        return self.table.shards(i % n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Ranks):
            return self.table is other.table or self.table.digest == other.table.digest
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(tuple(a) == tuple(b) for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.table.digest)

    def __repr__(self) -> str:
        return f"<shards of {len(self)} ranks, {len(self.table.names)} tensors>"


class RankShards(Sequence[TensorShard]):
    """Rank `rank` of a ShardTable as a sequence of TensorShard (made on first use). What decode_meta
    hands out: code that wants objects gets them, code that knows tables (ShardTable.stack) reads the
    arrays without making any."""

    __slots__ = ("rank", "table")

    def __init__(self, table: ShardTable, rank: int) -> None:
        self.table = table
        self.rank = rank

    def __len__(self) -> int:
        return int(self.table.indptr[self.rank + 1] - self.table.indptr[self.rank])

    @overload
    def __getitem__(self, i: int) -> TensorShard: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[TensorShard]: ...

    def __getitem__(self, i: int | slice) -> TensorShard | Sequence[TensorShard]:
        return self.table.shards(self.rank)[i]

    def __iter__(self) -> Iterator[TensorShard]:
        return iter(self.table.shards(self.rank))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return self.table.shards(self.rank) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.table.shards(self.rank))

    def __repr__(self) -> str:
        return f"<{len(self)} shards of {self.table.kind} rank {self.rank}>"


# --- binary encoding ------------------------------------------------------------------------------------

_BLOB = struct.Struct("<4sB3xI")  # magic, version, JSON header length; then the header, then 8-aligned arrays
_BLOB_MAGIC = b"WSPB"
_BLOB_VERSION = 1
_WIRE_DTYPES = {"|u1", "<u2", "<u4", "<u8", "<i4", "<i8", "|b1"}


def pack_arrays(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """A self-describing binary blob: a JSON header (`meta` and where each array lies), then the arrays'
    little-endian bytes. Deterministic: the same meta and arrays give the same bytes."""
    sections: list[list[Any]] = []
    chunks: list[bytes | memoryview] = []
    pos = 0
    for name, a in arrays.items():
        le = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        pad = -pos % 8
        if pad:
            chunks.append(b"\0" * pad)
            pos += pad
        sections.append([name, le.dtype.str, list(le.shape), pos, le.nbytes])
        chunks.append(le.data.cast("B") if le.nbytes else b"")
        pos += le.nbytes
    head = json.dumps({"meta": meta, "sections": sections}, separators=(",", ":"), sort_keys=True).encode()
    prefix = _BLOB.pack(_BLOB_MAGIC, _BLOB_VERSION, len(head)) + head
    return b"".join([prefix, b"\0" * (-len(prefix) % 8), *chunks])


def unpack_arrays(buf: bytes | memoryview) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of pack_arrays; the arrays are read-only views of `buf`. Raises ValueError on anything
    malformed (sizes are checked before any array is made)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _BLOB.size:
        raise ValueError("too short for a weightsync blob")
    magic, version, hlen = _BLOB.unpack_from(mv)
    if magic != _BLOB_MAGIC or version != _BLOB_VERSION:
        raise ValueError(f"not a weightsync blob (magic {bytes(magic)!r}, version {version})")
    end = _BLOB.size + hlen
    if end > len(mv):
        raise ValueError("blob header runs past the end")
    doc = json.loads(bytes(mv[_BLOB.size:end]))
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("sections"), list):
        raise ValueError("blob header lacks meta/sections")
    base = end + (-end % 8)
    arrays: dict[str, np.ndarray] = {}
    for sec in doc["sections"]:
        if not (isinstance(sec, list) and len(sec) == 5 and isinstance(sec[0], str) and sec[1] in _WIRE_DTYPES
                and isinstance(sec[2], list) and all(isinstance(x, int) and x >= 0 for x in sec[2])
                and isinstance(sec[3], int) and isinstance(sec[4], int) and sec[3] >= 0):
            raise ValueError(f"bad blob section {sec!r}"[:200])
        name, dt, shape, off, nbytes = sec
        dtype = np.dtype(dt)
        count = math.prod(shape)
        if count * dtype.itemsize != nbytes or base + off + nbytes > len(mv):
            raise ValueError(f"blob section {name!r} does not fit the blob")
        arrays[name] = np.frombuffer(mv, dtype=dtype, count=count, offset=base + off).reshape(shape)
    return doc["meta"], arrays


def _uwidth(span: int) -> int:
    """Bytes per value needed for 0..span (0: the column is constant)."""
    if span == 0:
        return 0
    return next(w for w in (1, 2, 4, 8) if span < 1 << (8 * w))


def _put_column(arrays: dict[str, np.ndarray], name: str, col: np.ndarray, flip: int | None = None) -> list[int]:
    """Store an integer column (or `flip - col`) as value - min in the narrowest unsigned type, in one
    pass; returns [min, width] (width 0: every value is min and nothing is stored)."""
    if not len(col):
        return [0, 0]
    cmin, cmax = int(col.min()), int(col.max())
    lo, hi = (cmin, cmax) if flip is None else (flip - cmax, flip - cmin)
    w = _uwidth(hi - lo)
    if w:
        out = np.empty(len(col), dtype=f"<u{w}")
        if flip is None:
            np.subtract(col, lo, out=out, casting="unsafe")
        else:
            np.subtract(cmax, col, out=out, casting="unsafe")  # flip - col - lo
        arrays[name] = out
    return [lo, w]


def _spec(spec: Any, name: str) -> tuple[int, int]:
    if not (isinstance(spec, list) and len(spec) == 2 and all(isinstance(x, int) for x in spec)
            and spec[1] in (0, 1, 2, 4, 8) and abs(spec[0]) < 1 << 62):
        raise ValueError(f"bad column spec for {name}")
    return spec[0], spec[1]


def _get_column(arrays: Mapping[str, np.ndarray], name: str, spec: Any, n: int) -> np.ndarray:
    lo, w = _spec(spec, name)
    if w == 0:
        return np.full(n, lo, dtype=np.int64)
    a = arrays.get(name)
    if a is None or a.shape != (n,) or a.dtype.itemsize != w:
        raise ValueError(f"column {name} is missing or has the wrong size")
    return a.astype(np.int64) + lo


def _read_column(arrays: Mapping[str, np.ndarray], name: str, spec: Any, out: np.ndarray,
                 flip: int | np.ndarray | None = None) -> None:
    """Inverse of _put_column, written into `out` (int32 or int64) without int64 temporaries."""
    lo, w = _spec(spec, name)
    limit = np.iinfo(out.dtype).max
    if w == 0:
        if flip is None:
            out.fill(lo)
        elif isinstance(flip, int):
            out.fill(flip - lo)
        else:
            np.subtract(flip, lo, out=out)
        return
    a = arrays.get(name)
    if a is None or a.shape != out.shape or a.dtype.itemsize != w:
        raise ValueError(f"column {name} is missing or has the wrong size")
    if not 0 <= lo <= limit or lo + (int(a.max()) if w >= out.dtype.itemsize else (1 << 8 * w) - 1) > limit:
        raise ValueError(f"column {name} does not fit {out.dtype}")
    out[...] = a
    out += lo
    if flip is not None:
        np.subtract(flip, out, out=out)


_NAMES: dict[bytes, tuple[str, ...]] = {}  # name tables seen: every pod's metadata carries the same one


_ENCODED: dict[int, tuple[tuple[str, ...], np.ndarray, np.ndarray]] = {}  # id(names) -> (names, lengths, utf-8)


def _encode_names(names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    got = _ENCODED.get(id(names))
    if got is not None and got[0] is names:
        return got[1], got[2]
    enc = [n.encode() for n in names]
    lens, blob = np.array([len(e) for e in enc], dtype="<u4"), np.frombuffer(b"".join(enc), dtype=np.uint8)
    if len(_ENCODED) >= 16:
        _ENCODED.pop(next(iter(_ENCODED)))
    _ENCODED[id(names)] = (names, lens, blob)  # holding `names` keeps its id from being reused
    return lens, blob


def _decode_names(lens_a: np.ndarray, blob_a: np.ndarray, T: int) -> tuple[str, ...]:
    import xxhash

    h = xxhash.xxh3_128(lens_a.tobytes())
    h.update(blob_a.tobytes())
    key = h.digest()
    got = _NAMES.get(key)
    if got is not None and len(got) == T:
        return got
    lens, blob = lens_a.astype(np.int64), blob_a.tobytes()
    if lens.shape != (T,) or int(lens.sum()) != len(blob):
        raise ValueError("tensor names do not add up")
    ends = np.cumsum(lens).tolist()
    names = tuple(blob[a:b].decode() for a, b in zip([0, *ends][: len(ends)], ends, strict=True))
    if len(_NAMES) >= 16:
        _NAMES.pop(next(iter(_NAMES)))
    _NAMES[key] = names
    return names


# --- columnar shards ------------------------------------------------------------------------------------


def _as_i64(a: Any, ndim: int) -> np.ndarray:
    out = np.ascontiguousarray(a, dtype=np.int64)
    if out.ndim != ndim:
        raise PlanError(f"expected a {ndim}-d array, got shape {out.shape}")
    return out


_I32_MAX = (1 << 31) - 1


def coord_dtype(max_dim: int) -> type[np.signedinteger[Any]]:
    """int32 box coordinates when every dim fits (half the memory and bandwidth), else int64."""
    return np.int32 if max_dim <= _I32_MAX else np.int64


class ShardTable:
    """Every rank's shards of one side (sources or needs), as arrays.

    Why: 70,000 tensors on 256 ranks are 18M shards; as objects they take minutes and gigabytes, as
    arrays a plan over them takes seconds. Tensors are sorted by name and a tensor's id is its position;
    rank r's rows are `indptr[r]:indptr[r + 1]`, sorted by tensor id, at most one per tensor. Boxes are
    columns: `off[k]` / `shp[k]` hold dim k of every row (dim-major, so per-dim arithmetic is contiguous),
    in int32 unless a global dim needs int64; dims are padded to `ndim_max` with offset 0 and size 1.
    Treat it as immutable: derived data (encoding, digest, dense view, shard objects) is memoized.
    """

    def __init__(self, names: Sequence[str], dtypes: Sequence[str], gshape: Any, ndim: Any, indptr: Any,
                 tensor: Any, offset: Any, shape: Any, *, kind: str = "source", check: bool = True,
                 dims_first: bool = False) -> None:
        """`offset` / `shape` are [rows, dims] (or [dims, rows] with dims_first)."""
        self.names: tuple[str, ...] = tuple(names)
        self.dtypes: tuple[str, ...] = tuple(dtypes)
        self.gshape = _as_i64(gshape, 2)
        self.ndim = _as_i64(ndim, 1)
        self.indptr = _as_i64(indptr, 1)
        self.tensor = np.ascontiguousarray(tensor, dtype=np.int32)
        self.cdt = coord_dtype(int(self.gshape.max()) if self.gshape.size else 0)
        off, shp = np.asarray(offset), np.asarray(shape)
        if off.ndim != 2 or shp.ndim != 2:
            raise PlanError(f"{kind} table: boxes must be 2-d arrays, got {off.shape} / {shp.shape}")
        if not dims_first:
            off, shp = off.T, shp.T
        narrow = self.cdt == np.int32 and off.dtype.itemsize > 4
        if check and narrow and off.size and (max(off.max(), shp.max()) > _I32_MAX or min(off.min(), shp.min()) < 0):
            raise PlanError(f"{kind} table: box coordinates must lie in 0..{int(self.gshape.max())}")
        self.off = np.ascontiguousarray(off, dtype=self.cdt)
        self.shp = np.ascontiguousarray(shp, dtype=self.cdt)
        self.kind = kind
        self._shards: dict[int, tuple[TensorShard, ...]] = {}
        self._sections: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None
        if check:
            self._check()

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_lists(cls, ranks: Sequence[Sequence[TensorShard]], kind: str = "source") -> ShardTable:
        """From per-rank lists of TensorShard; raises the PlanError the rules call for (a tensor twice on
        one rank, two ranks disagreeing on a tensor's dtype or global shape)."""
        meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
        for r, shards in enumerate(ranks):
            seen: set[str] = set()
            for s in shards:
                if s.name in seen:
                    raise PlanError(f"{kind} rank {r} lists tensor {s.name!r} twice; one box per tensor and rank")
                seen.add(s.name)
                m = meta.get(s.name)
                if m is None:
                    meta[s.name] = (s.dtype, s.global_shape, r)
                elif (m[0], m[1]) != (s.dtype, s.global_shape):
                    raise PlanError(
                        f"tensor {s.name!r}: {kind} rank {m[2]} says {m[0]}{list(m[1])} but {kind} rank {r} says "
                        f"{s.dtype}{list(s.global_shape)}; trainer and inference must describe the same model"
                    )
        names = sorted(meta)
        idx = {n: i for i, n in enumerate(names)}
        D = max([1, *(len(m[1]) for m in meta.values())])
        gshape = np.ones((len(names), D), dtype=np.int64)
        ndim = np.zeros(len(names), dtype=np.int64)
        for i, n in enumerate(names):
            gs = meta[n][1]
            ndim[i] = len(gs)
            gshape[i, : len(gs)] = gs
        indptr = [0]
        tensor: list[int] = []
        offs: list[tuple[int, ...]] = []
        shps: list[tuple[int, ...]] = []
        for shards in ranks:
            for s in sorted(shards, key=lambda s: idx[s.name]):
                pad = D - s.box.ndim
                tensor.append(idx[s.name])
                offs.append(s.box.offset + (0,) * pad)
                shps.append(s.box.shape + (1,) * pad)
            indptr.append(len(tensor))
        return cls(names, [meta[n][0] for n in names], gshape, ndim, indptr, tensor,
                   np.array(offs, dtype=np.int64).reshape(-1, D), np.array(shps, dtype=np.int64).reshape(-1, D),
                   kind=kind, check=False)

    @classmethod
    @_streamed
    def from_dense(cls, names: Sequence[str], dtypes: Sequence[str], global_shapes: Sequence[Sequence[int]],
                   offset: np.ndarray, shape: np.ndarray, present: np.ndarray | None = None, *,
                   kind: str = "source", dims_first: bool = False) -> ShardTable:
        """From [ranks, tensors, dims] offset/shape arrays ([dims, ranks, tensors] with dims_first; dims
        padded with offset 0, shape 1) and an optional [ranks, tensors] mask of the shards that exist:
        what a vectorized layout produces. Tensors need not be sorted by name."""
        if not dims_first:
            offset, shape = np.moveaxis(offset, 2, 0), np.moveaxis(shape, 2, 0)
        T = len(names)
        D = offset.shape[0] if offset.ndim == 3 else 0
        R = offset.shape[1] if offset.ndim == 3 else 0
        if offset.shape != (D, R, T) or shape.shape != (D, R, T) or D < 1:
            raise PlanError(f"offset/shape must be [ranks, {T} tensors, dims >= 1], got {offset.shape} / {shape.shape}")
        order = sorted(range(T), key=names.__getitem__)
        if order != list(range(T)):
            names = [names[i] for i in order]
            dtypes = [dtypes[i] for i in order]
            global_shapes = [global_shapes[i] for i in order]
            offset, shape = offset[:, :, order], shape[:, :, order]
            present = None if present is None else present[:, order]
        gshape = np.ones((T, D), dtype=np.int64)
        ndim = np.zeros(T, dtype=np.int64)
        for i, gs in enumerate(global_shapes):
            if len(gs) > D:
                raise PlanError(f"tensor {names[i]!r} has {len(gs)} dims but the arrays only {D}")
            ndim[i] = len(gs)
            gshape[i, : len(gs)] = gs
        tensor: np.ndarray
        if present is None:
            indptr = np.arange(R + 1, dtype=np.int64) * T
            tensor = np.tile(np.arange(T, dtype=np.int32), R)
            off, shp = offset.reshape(D, R * T), shape.reshape(D, R * T)
        else:
            r_idx, t_idx = np.nonzero(present)
            indptr = np.concatenate([[0], np.cumsum(np.bincount(r_idx, minlength=R))])
            tensor = t_idx
            off, shp = offset[:, r_idx, t_idx], shape[:, r_idx, t_idx]
        return cls(names, dtypes, gshape, ndim, indptr, tensor, off, shp, kind=kind, dims_first=True)

    @classmethod
    @_streamed
    def split_even(cls, tensors: ShardTable, dims: np.ndarray, parts: int, kind: str = "destination") -> ShardTable:
        """`parts` ranks, rank r holding part r of every tensor of `tensors` (names, dtypes, global
        shapes) split evenly along dims[t] (-1: the whole tensor): a tensor-parallel layout. The caller
        checks divisibility."""
        T, D = len(tensors.names), tensors.ndim_max
        g = tensors.gshape.T.astype(tensors.cdt)  # [dims, tensors]
        off = np.zeros((D, parts, T), dtype=tensors.cdt)
        shp = np.broadcast_to(g[:, None, :], (D, parts, T)).copy()
        for k in range(D):
            sel = dims == k
            if sel.any():
                size = g[k, sel] // parts
                off[k][:, sel] = np.arange(parts, dtype=tensors.cdt)[:, None] * size[None, :]
                shp[k][:, sel] = size[None, :]
        return cls(tensors.names, tensors.dtypes, tensors.gshape, tensors.ndim, np.arange(parts + 1) * T,
                   np.tile(np.arange(T, dtype=np.int32), parts), off.reshape(D, parts * T), shp.reshape(D, parts * T),
                   kind=kind, check=False, dims_first=True)

    @classmethod
    @_streamed
    def stack(cls, rows: Sequence[tuple[ShardTable, int] | None], kind: str = "source") -> ShardTable:
        """A table whose rank r is rank `rows[r][1]` of table `rows[r][0]` (None: holds nothing). Used to
        join the per-pod metadata of every trainer pod into the sources of a plan; tensors no rank holds
        are left out, and the tables must agree on the dtype and global shape of every tensor."""
        tables: list[ShardTable] = []
        for item in rows:
            if item is not None and all(item[0] is not t for t in tables):
                tables.append(item[0])
        if not tables:
            return cls([], [], np.ones((0, 1)), [], np.zeros(len(rows) + 1), [], np.zeros((0, 1)),
                       np.zeros((0, 1)), kind=kind, check=False)
        first = tables[0]
        D = max(t.ndim_max for t in tables)
        wide = [t.padded(D) for t in tables]
        names: Sequence[str]
        maps: list[np.ndarray | None]
        if all(t.names == first.names and t.dtypes == first.dtypes and np.array_equal(w.gshape, wide[0].gshape)
               and np.array_equal(t.ndim, first.ndim) for t, w in zip(tables, wide, strict=True)):
            # one tensor table (every trainer pod publishes the same model): nothing to merge or check
            names, maps = first.names, [None] * len(tables)
            dtypes: list[str | None] = list(first.dtypes)
            gshape, ndim = wide[0].gshape, first.ndim
        else:
            names = sorted(set().union(*(t.names for t in tables)))
            idx = {n: i for i, n in enumerate(names)}
            maps = [np.array([idx[n] for n in t.names], dtype=np.int32) for t in tables]
            dtypes, gshape, ndim = cls._merge_tensors(tables, wide, maps, len(names), D, kind)
        T = len(names)
        pos = {id(t): i for i, t in enumerate(tables)}
        cdt = np.int64 if any(w.cdt == np.int64 for w in wide) else np.int32
        indptr = [0]
        tens: list[np.ndarray] = []
        offs: list[np.ndarray] = []
        shps: list[np.ndarray] = []
        for item in rows:
            if item is not None:
                i = pos[id(item[0])]
                sl = wide[i].rank_rows(item[1])
                m = maps[i]
                tt = wide[i].tensor[sl]
                tens.append(tt if m is None else m[tt])
                offs.append(wide[i].off[:, sl])
                shps.append(wide[i].shp[:, sl])
                indptr.append(indptr[-1] + len(tt))
            else:
                indptr.append(indptr[-1])
        tensor = np.concatenate(tens) if tens else np.zeros(0, np.int32)
        off = np.concatenate(offs, axis=1, dtype=cdt) if offs else np.zeros((D, 0), cdt)
        shp = np.concatenate(shps, axis=1, dtype=cdt) if shps else np.zeros((D, 0), cdt)
        held = np.zeros(T, dtype=bool)
        held[tensor] = True
        if not held.all():  # drop tensors no selected rank holds (e.g. pods an IPC group cannot read)
            keep = np.flatnonzero(held)
            remap = (np.cumsum(held) - 1).astype(np.int32)
            names = [names[i] for i in keep.tolist()]
            dtypes = [dtypes[i] for i in keep.tolist()]
            gshape, ndim, tensor = gshape[keep], ndim[keep], remap[tensor]
        return cls(names, [str(d) for d in dtypes], gshape, ndim, indptr, tensor, off, shp, kind=kind, check=False,
                   dims_first=True)

    @staticmethod
    def _merge_tensors(tables: list[ShardTable], wide: list[ShardTable], maps: list[np.ndarray | None], T: int,
                       D: int, kind: str) -> tuple[list[str | None], np.ndarray, np.ndarray]:
        """dtype, global shape and ndim of every tensor of a union of tables; PlanError on disagreement."""
        dtypes: list[str | None] = [None] * T
        gshape = np.ones((T, D), dtype=np.int64)
        ndim = np.full(T, -1, dtype=np.int64)
        for t, w, m in zip(tables, wide, maps, strict=True):
            ids = np.arange(T) if m is None else m
            fresh = ndim[ids] < 0
            gshape[ids[fresh]] = w.gshape[fresh]
            ndim[ids[fresh]] = t.ndim[fresh]
            for j in np.flatnonzero(fresh).tolist():
                dtypes[int(ids[j])] = t.dtypes[j]
            clash = (~fresh) & ((ndim[ids] != t.ndim) | (gshape[ids] != w.gshape).any(axis=1)
                                | np.array([dtypes[int(i)] != dt for i, dt in zip(ids.tolist(), t.dtypes, strict=True)]))
            if clash.any():
                name = t.names[int(np.flatnonzero(clash)[0])]
                other = next(o for o in tables if o is not t and name in o.index)
                a, b = other._one(name), t._one(name)
                raise PlanError(f"tensor {name!r}: one {kind} rank says {a.dtype}{list(a.global_shape)} but another "
                                f"says {b.dtype}{list(b.global_shape)}; trainer and inference must describe the same model")
        return dtypes, gshape, ndim

    def _check(self, rows_sorted: bool = False) -> None:
        """Raise PlanError unless the table keeps its invariants (rows_sorted: the row order is known to
        be right, as when it was decoded from a presence bitmap)."""
        T = len(self.names)
        D = self.gshape.shape[1]
        N = len(self.tensor)
        kind = self.kind
        if D < 1 or self.gshape.shape[0] != T or len(self.dtypes) != T or self.ndim.shape != (T,):
            raise PlanError(f"{kind} table: {T} names, {len(self.dtypes)} dtypes, global shapes {self.gshape.shape}, "
                            f"ndims {self.ndim.shape} do not match")
        for a, b in itertools.pairwise(self.names):
            if not a < b:
                raise PlanError(f"{kind} table: tensor names must be sorted and unique ({a!r} before {b!r})")
        for dt in set(self.dtypes):
            to_dtype(dt)
        if (self.ndim < 0).any() or (self.ndim > D).any():
            raise PlanError(f"{kind} table: a tensor has more dims than the table's {D}")
        pad = np.arange(D)[None, :] >= self.ndim[:, None]
        if (self.gshape < 0).any() or (self.gshape[pad] != 1).any():
            raise PlanError(f"{kind} table: global shapes must be non-negative (padding dims 1)")
        ip = self.indptr
        if len(ip) < 1 or ip[0] != 0 or ip[-1] != N or (np.diff(ip) < 0).any():
            raise PlanError(f"{kind} table: row pointers do not cover its {N} rows")
        if self.off.shape != (D, N) or self.shp.shape != (D, N):
            raise PlanError(f"{kind} table: {N} rows but boxes of shape {self.off.shape} / {self.shp.shape}")
        if not N:
            return
        if self.tensor.min() < 0 or self.tensor.max() >= T:
            raise PlanError(f"{kind} table: a row names tensor id outside 0..{T - 1}")
        ok = np.ones(N - 1, dtype=bool) if rows_sorted else np.diff(self.tensor) > 0
        starts = ip[1:-1]
        ok[starts[(starts > 0) & (starts < N)] - 1] = True
        if not ok.all():
            i = int(np.argmin(ok)) + 1
            r = self.rank_of(i)
            name = self.names[int(self.tensor[i])]
            if self.tensor[i] == self.tensor[i - 1]:
                raise PlanError(f"{kind} rank {r} lists tensor {name!r} twice; one box per tensor and rank")
            raise PlanError(f"{kind} table: the rows of rank {r} are not sorted by tensor name (at {name!r})")
        bad = np.zeros(N, dtype=bool)
        for k in range(D):
            o, s = self.off[k], self.shp[k]
            col = self.gshape[:, k]
            if (col == col[0]).all() and not pad[:, k].any():  # same size in every tensor: no per-row gather
                bad |= (o < 0) | (s < 0) | (o > col[0]) | (s > int(col[0]) - o)
                continue
            g = col.astype(self.cdt)[self.tensor]
            bad |= (o < 0) | (s < 0) | (o > g) | (s > g - o)
            padk = pad[:, k]
            if padk.any():
                bad |= padk[self.tensor] & ((o != 0) | (s != 1))
        if bad.any():
            i = int(np.argmax(bad))
            t = int(self.tensor[i])
            n = int(self.ndim[t])
            raise PlanError(
                f"tensor {self.names[t]!r}: box offset={tuple(self.off[:n, i].tolist())} "
                f"shape={tuple(self.shp[:n, i].tolist())} is outside its global shape {self.global_shape(t)} "
                f"({kind} rank {self.rank_of(i)})"
            )

    # -- access -----------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.indptr) - 1

    def __len__(self) -> int:
        return self.num_ranks

    @property
    def num_rows(self) -> int:
        return len(self.tensor)

    @property
    def ndim_max(self) -> int:
        return int(self.gshape.shape[1])

    @property
    def offset(self) -> np.ndarray:
        """[rows, dims] view of the offsets."""
        return self.off.T

    @property
    def shape(self) -> np.ndarray:
        """[rows, dims] view of the local shapes."""
        return self.shp.T

    @cached_property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def rank_of(self, row: int) -> int:
        return int(np.searchsorted(self.indptr, row, side="right")) - 1

    def rank_rows(self, r: int) -> slice:
        return slice(int(self.indptr[r]), int(self.indptr[r + 1]))

    def global_shape(self, t: int) -> tuple[int, ...]:
        return self._gshapes[t]

    @cached_property
    def _gshapes(self) -> list[tuple[int, ...]]:
        D = self.ndim_max
        full = _rows(self.gshape.T, slice(None))
        return [g if n == D else g[:n] for g, n in zip(full, self.ndim.tolist(), strict=True)]

    def shards(self, r: int) -> tuple[TensorShard, ...]:
        """Rank r's shards as objects, sorted by name (made once)."""
        got = self._shards.get(r)
        if got is None:
            sl = self.rank_rows(r)
            names, dtypes, gshapes, nd, D = self.names, self.dtypes, self._gshapes, self.ndim.tolist(), self.ndim_max
            out = []
            for t, o, s in zip(self.tensor[sl].tolist(), _rows(self.off, sl), _rows(self.shp, sl), strict=True):
                n = nd[t]
                out.append(_shard(names[t], dtypes[t], gshapes[t], _box(o, s) if n == D else _box(o[:n], s[:n])))
            got = self._shards[r] = tuple(out)
        return got

    def _one(self, name: str) -> TensorShard:
        t = self.index[name]
        return _shard(name, self.dtypes[t], self._gshapes[t], Box.full(self._gshapes[t]))

    @cached_property
    def full_shards(self) -> dict[str, TensorShard]:
        """One whole-tensor shard per tensor (name, dtype, global shape): what layouts start from."""
        return {n: _shard(n, dt, gs, _box((0,) * len(gs), gs))
                for n, dt, gs in zip(self.names, self.dtypes, self._gshapes, strict=True)}

    @cached_property
    @_streamed
    def dense(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offset, shape) as [dims, ranks, tensors] arrays (absent shards: all zeros) and the [ranks,
        tensors] mask of present shards. No copy when every rank holds every tensor."""
        R, T, D = self.num_ranks, len(self.names), self.ndim_max
        if self.num_rows == R * T and (T == 0 or bool((self.tensor.reshape(R, T) == np.arange(T)).all())):
            return self.off.reshape(D, R, T), self.shp.reshape(D, R, T), np.ones((R, T), dtype=bool)
        off = np.zeros((D, R, T), dtype=self.cdt)
        shp = np.zeros((D, R, T), dtype=self.cdt)
        present = np.zeros((R, T), dtype=bool)
        r_of = np.repeat(np.arange(R), np.diff(self.indptr))
        for k in range(D):
            off[k][r_of, self.tensor] = self.off[k]
            shp[k][r_of, self.tensor] = self.shp[k]
        present[r_of, self.tensor] = True
        return off, shp, present

    def padded(self, dims: int) -> ShardTable:
        """The same table with boxes padded to `dims` dims (itself when it has that many already)."""
        have = self.ndim_max
        if have == dims:
            return self
        if have > dims:
            raise PlanError(f"cannot pad a {have}-dim table to {dims} dims")
        extra = dims - have
        g = np.concatenate([self.gshape, np.ones((len(self.names), extra), dtype=np.int64)], axis=1)
        off = np.concatenate([self.off, np.zeros((extra, self.num_rows), dtype=self.cdt)])
        shp = np.concatenate([self.shp, np.ones((extra, self.num_rows), dtype=self.cdt)])
        return ShardTable(self.names, self.dtypes, g, self.ndim, self.indptr, self.tensor, off, shp, kind=self.kind,
                          check=False, dims_first=True)

    # -- encoding ---------------------------------------------------------------------------------------
    @_streamed
    def sections(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The table as (meta, arrays) for pack_arrays: names, dtypes, global shapes, which tensors each
        rank holds (a bitmap or id list, whichever is smaller) and each box column in the narrowest
        integer type (shapes as the distance to the global shape, mostly constant 0). Memoized."""
        if self._sections is not None:
            return self._sections
        T, D, R, N = len(self.names), self.ndim_max, self.num_ranks, self.num_rows
        name_len, name_utf8 = _encode_names(self.names)
        kinds = sorted(set(self.dtypes))
        code = {d: i for i, d in enumerate(kinds)}
        arrays: dict[str, np.ndarray] = {
            "name_len": name_len,
            "name_utf8": name_utf8,
            "dtype": np.array([code[d] for d in self.dtypes], dtype=np.uint8),
            "ndim": self.ndim.astype(np.uint8),
            "gshape": self.gshape,
        }
        meta: dict[str, Any] = {"tensors": T, "dims": D, "ranks": R, "rows": N, "dtypes": kinds}
        bitmap_bytes, list_bytes = (R * T + 7) // 8, 8 * (R + 1) + N * max(1, _uwidth(max(T - 1, 0)))
        if bitmap_bytes <= list_bytes and N == R * T:  # every rank holds every tensor
            bits = np.full(bitmap_bytes, 255, dtype=np.uint8)
            if N % 8:
                bits[-1] = (0xFF00 >> (N % 8)) & 0xFF
            arrays["present"] = bits
            meta["rows_as"] = "bitmap"
        elif bitmap_bytes <= list_bytes:
            present = np.zeros((R, T), dtype=bool)
            present[np.repeat(np.arange(R), np.diff(self.indptr)), self.tensor] = True
            arrays["present"] = np.packbits(present.reshape(-1))
            meta["rows_as"] = "bitmap"
        else:
            arrays["indptr"] = self.indptr
            meta["rows_as"] = "list"
            meta["tensor"] = _put_column(arrays, "tensor", self.tensor.astype(np.int64))
        meta["offset"] = [_put_column(arrays, f"offset{k}", self.off[k]) for k in range(D)]
        short = []
        for k in range(D):
            col = self.gshape[:, k]
            if not N or (col == col[0]).all():  # the same size in every tensor: no per-row gather
                short.append(_put_column(arrays, f"short{k}", self.shp[k], flip=int(col[0]) if T else 0))
            else:
                short.append(_put_column(arrays, f"short{k}", col.astype(self.cdt)[self.tensor] - self.shp[k]))
        meta["short"] = short
        self._sections = (meta, arrays)
        return self._sections

    @classmethod
    @_streamed
    def from_sections(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], kind: str = "source") -> ShardTable:
        """Inverse of sections(); validates everything (the bytes came from a peer). Raises ValueError."""
        try:
            T, D, R, N = (int(meta[k]) for k in ("tensors", "dims", "ranks", "rows"))
            kinds = [str(d) for d in meta["dtypes"]]
            if min(T, D, R, N) < 0 or D < 1:
                raise ValueError("negative sizes")
            names = _decode_names(arrays["name_len"], arrays["name_utf8"], T)
            code = arrays["dtype"]
            if code.shape != (T,) or (T and int(code.max()) >= len(kinds)):
                raise ValueError("bad dtype codes")
            dtypes = [kinds[c] for c in code.tolist()]
            ndim = arrays["ndim"].astype(np.int64)
            gshape = arrays["gshape"]
            if gshape.shape != (T, D) or ndim.shape != (T,) or gshape.dtype != np.int64:
                raise ValueError("bad global shapes")
            if meta["rows_as"] == "bitmap":
                bits = arrays["present"]
                if bits.shape != ((R * T + 7) // 8,):
                    raise ValueError("bad presence bitmap")
                if N == R * T:  # every rank holds every tensor
                    full_bytes_ok = not (bits[: N // 8] != 255).any()
                    tail_ok = N % 8 == 0 or bits[-1] == (0xFF00 >> (N % 8)) & 0xFF
                    if not (full_bytes_ok and tail_ok):
                        raise ValueError("presence bitmap and row count disagree")
                    indptr = np.arange(R + 1, dtype=np.int64) * T
                    tensor = np.tile(np.arange(T, dtype=np.int32), R)
                else:
                    r_idx, t_idx = np.nonzero(np.unpackbits(bits, count=R * T).reshape(R, T))
                    if len(t_idx) != N:
                        raise ValueError("presence bitmap and row count disagree")
                    indptr = np.concatenate([[0], np.cumsum(np.bincount(r_idx, minlength=R))])
                    tensor = t_idx.astype(np.int32)
            elif meta["rows_as"] == "list":
                indptr = arrays["indptr"]
                if indptr.shape != (R + 1,):
                    raise ValueError("bad row pointers")
                tensor = _get_column(arrays, "tensor", meta["tensor"], N)
            else:
                raise ValueError(f"unknown row encoding {meta['rows_as']!r}")
            if N and (tensor.min() < 0 or tensor.max() >= T):
                raise ValueError("tensor id out of range")
            specs_o, specs_s = meta["offset"], meta["short"]
            if len(specs_o) != D or len(specs_s) != D:
                raise ValueError("column specs do not match dims")
            if (gshape < 0).any():
                raise ValueError("negative global shape")
            cdt = coord_dtype(int(gshape.max()) if T else 0)
            off = np.empty((D, N), dtype=cdt)
            shp = np.empty((D, N), dtype=cdt)
            for k in range(D):
                col = gshape[:, k]
                flip = (int(col[0]) if T else 0) if not N or (col == col[0]).all() else col.astype(cdt)[tensor]
                _read_column(arrays, f"offset{k}", specs_o[k], off[k])
                _read_column(arrays, f"short{k}", specs_s[k], shp[k], flip)
        except (KeyError, TypeError, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"bad shard table: {exc!r}") from None
        table = cls(names, dtypes, gshape, ndim, indptr, tensor, off, shp, kind=kind, check=False, dims_first=True)
        table._check(rows_sorted=meta["rows_as"] == "bitmap")
        table._sections = (dict(meta), dict(arrays))  # the digest is over the bytes both sides hold
        return table

    def encode(self) -> bytes:
        meta, arrays = self.sections()
        return pack_arrays({"table": meta}, arrays)

    @classmethod
    def decode(cls, buf: bytes | memoryview, kind: str = "source") -> ShardTable:
        meta, arrays = unpack_arrays(buf)
        if not isinstance(meta.get("table"), dict):
            raise ValueError("not a shard table")
        return cls.from_sections(meta["table"], arrays, kind)

    @cached_property
    def tensors_digest(self) -> str:
        """SHA-256 of the tensor table alone (names, dtypes, global shapes): what a layout depends on."""
        h = hashlib.sha256(json.dumps([self.names, self.dtypes]).encode())
        h.update(np.ascontiguousarray(self.ndim, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.gshape, dtype="<i8").tobytes())
        return h.hexdigest()

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the table's encoding: equal tables (in the same encoding) have equal digests."""
        meta, arrays = self.sections()
        h = hashlib.sha256(json.dumps(meta, separators=(",", ":"), sort_keys=True).encode())
        for name, a in arrays.items():
            le = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
            h.update(f"|{name}|{le.dtype.str}|{list(le.shape)}|".encode())
            h.update(le.data.cast("B") if le.nbytes else b"")
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"ShardTable({self.kind}: {self.num_ranks} ranks, {len(self.names)} tensors, {self.num_rows} shards)"


class PlanInputs:
    """What a plan is computed from: both sides' tables, the bucket size and alignment. The destination
    sends `payload` to every source it reads from; `key` (SHA-256 of the payload) names the plan in the
    plan caches of both sides. Both are computed once per object."""

    def __init__(self, sources: ShardTable, needs: ShardTable, bucket_bytes: int,
                 alignment: int = DEFAULT_ALIGNMENT, *, payload: bytes | memoryview | None = None) -> None:
        self.sources = sources
        self.needs = needs
        self.bucket_bytes = int(bucket_bytes)
        self.alignment = int(alignment)
        if payload is not None:
            self.__dict__["payload"] = bytes(payload)

    @cached_property
    @_streamed
    def payload(self) -> bytes:
        ms, a_s = self.sources.sections()
        mn, a_n = self.needs.sections()
        arrays = {**{f"s.{k}": v for k, v in a_s.items()}, **{f"n.{k}": v for k, v in a_n.items()}}
        meta = {"plan_inputs": PLAN_FORMAT, "bucket_bytes": self.bucket_bytes, "alignment": self.alignment,
                "sources": ms, "needs": mn}
        return pack_arrays(meta, arrays)

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> PlanInputs:
        """Raises ValueError (PlanError for inputs that are well-formed but break the rules)."""
        meta, arrays = unpack_arrays(payload)
        if meta.get("plan_inputs") != PLAN_FORMAT:
            raise ValueError(f"plan inputs of format {meta.get('plan_inputs')!r}, this agent reads {PLAN_FORMAT}")
        bb, al = meta.get("bucket_bytes"), meta.get("alignment")
        if not isinstance(bb, int) or not isinstance(al, int):
            raise ValueError("bucket_bytes and alignment must be integers")
        s = ShardTable.from_sections(meta["sources"], {k[2:]: v for k, v in arrays.items() if k.startswith("s.")})
        n = ShardTable.from_sections(meta["needs"], {k[2:]: v for k, v in arrays.items() if k.startswith("n.")},
                                     "destination")
        return cls(s, n, bb, al, payload=payload)

    def build(self) -> TransferPlan:
        return build_plan(self.sources, self.needs, self.bucket_bytes, alignment=self.alignment)


# --- the plan ---------------------------------------------------------------------------------------------


class _Core:
    """The plan as arrays. Pieces are in stream order ((src, dsts), then tensor, then offset), so a
    bucket's entries are the contiguous pieces b_lo[b]:b_hi[b]; buckets are in plan (index) order.
    Piece boxes are dim-major columns: p_off[k] / p_shp[k]."""

    def __init__(self, src: ShardTable, groups: list[tuple[int, ...]], p_tensor: np.ndarray, p_off: np.ndarray,
                 p_shp: np.ndarray, p_entry: np.ndarray, b_src: np.ndarray, b_grp: np.ndarray, b_lo: np.ndarray,
                 b_hi: np.ndarray, b_nbytes: np.ndarray, b_data: np.ndarray) -> None:
        self.src = src
        self.groups = groups
        self.p_tensor, self.p_off, self.p_shp, self.p_entry = p_tensor, p_off, p_shp, p_entry
        self.b_src, self.b_grp, self.b_lo, self.b_hi = b_src, b_grp, b_lo, b_hi
        self.b_nbytes, self.b_data = b_nbytes, b_data

    def entries(self, b: int) -> tuple[PlannedEntry, ...]:
        lo, hi = int(self.b_lo[b]), int(self.b_hi[b])
        src, dsts = int(self.b_src[b]), self.groups[int(self.b_grp[b])]
        S = self.src
        soff, sshp, _ = S.dense
        t = self.p_tensor[lo:hi]
        names, dtypes, gshapes, nd, D = S.names, S.dtypes, S._gshapes, S.ndim.tolist(), S.ndim_max
        sl = slice(lo, hi)
        out = []
        for ti, o, s, so, ss, eo in zip(t.tolist(), _rows(self.p_off, sl), _rows(self.p_shp, sl),
                                        _rows(soff[:, src], t), _rows(sshp[:, src], t), self.p_entry[sl].tolist(),
                                        strict=True):
            n = nd[ti]
            if n != D:
                o, s, so, ss = o[:n], s[:n], so[:n], ss[:n]
            piece = _new(Piece)
            d = piece.__dict__
            d["name"], d["dtype"], d["global_shape"], d["box"] = names[ti], dtypes[ti], gshapes[ti], _box(o, s)
            d["src"], d["src_box"], d["dsts"] = src, _box(so, ss), dsts
            entry = _new(PlannedEntry)
            entry.__dict__["piece"], entry.__dict__["offset"] = piece, eo
            out.append(entry)
        return tuple(out)

    @property
    def num_pieces(self) -> int:
        return len(self.p_tensor)

    def columns(self, b: int) -> BucketColumns:
        lo, hi, src = int(self.b_lo[b]), int(self.b_hi[b]), int(self.b_src[b])
        soff, sshp, _ = self.src.dense
        t = self.p_tensor[lo:hi]
        return BucketColumns(self.src.names, self.src.dtypes, self.src.ndim, t, self.p_off[:, lo:hi],
                             self.p_shp[:, lo:hi], soff[:, src, t], sshp[:, src, t], self.p_entry[lo:hi])


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The whole plan. Immutable and identical on every agent that computed it from the same inputs.

    `sources[r]` / `needs[r]` are rank r's shards sorted by name; `buckets` are in plan order (their
    entries become objects on first use)."""

    sources: Sequence[tuple[TensorShard, ...]]
    needs: Sequence[tuple[TensorShard, ...]]
    buckets: tuple[BucketPlan, ...]
    bucket_bytes: int
    alignment: int
    hash: str = field(compare=False)
    _core: _Core | None = field(default=None, compare=False, repr=False)

    @property
    def num_src(self) -> int:
        return len(self.sources)

    @property
    def num_dst(self) -> int:
        return len(self.needs)

    @property
    def num_pieces(self) -> int:
        return sum(len(b.entries) for b in self.buckets)

    @property
    def nbytes(self) -> int:
        """Memory the plan's arrays take (what a plan cache budgets; a 70k x 256 plan: ~1 GB)."""
        core = self._core
        if core is None:
            return 0
        arrays = (core.p_tensor, core.p_off, core.p_shp, core.p_entry, core.b_src, core.b_lo, core.b_hi)
        return sum(a.nbytes for a in arrays) + core.src.off.nbytes + core.src.shp.nbytes

    @cached_property
    def _by_rank(self) -> tuple[dict[int, list[BucketPlan]], dict[int, list[BucketPlan]]]:
        frm: dict[int, list[BucketPlan]] = {}
        to: dict[int, list[BucketPlan]] = {}
        for b in self.buckets:
            frm.setdefault(b.src, []).append(b)
            for d in b.dsts:
                to.setdefault(d, []).append(b)
        return frm, to

    def buckets_from(self, src: int) -> list[BucketPlan]:
        """The buckets source rank `src` sends, in plan order."""
        return list(self._by_rank[0].get(src, ()))

    def buckets_to(self, dst: int) -> list[BucketPlan]:
        """The buckets destination rank `dst` receives, in plan order."""
        return list(self._by_rank[1].get(dst, ()))

    def dsts_of(self, src: int) -> list[int]:
        return sorted({d for b in self._by_rank[0].get(src, ()) for d in b.dsts})

    def srcs_of(self, dst: int) -> list[int]:
        return sorted({b.src for b in self._by_rank[1].get(dst, ())})

    def max_bucket_nbytes(self, *, src: int | None = None, dst: int | None = None) -> int:
        """Largest bucket (optionally only those from `src` / to `dst`): the size of a reusable slot."""
        pool: Iterable[BucketPlan] = self.buckets
        if dst is not None:
            pool = self._by_rank[1].get(dst, ())
        elif src is not None:
            pool = self._by_rank[0].get(src, ())
        return max((b.nbytes for b in pool if src is None or b.src == src), default=0)

    def broadcast_groups(self) -> list[tuple[int, tuple[int, ...]]]:
        """Distinct (src, dsts) sets of broadcast buckets, sorted: transports create one group each."""
        return sorted({(b.src, b.dsts) for b in self.buckets if b.broadcast})

    def total_bytes(self) -> int:
        """Bytes a sender moves (a broadcast bucket counts once)."""
        return sum(b.nbytes for b in self.buckets)

    def delivered_bytes(self) -> int:
        """Bytes that arrive at destinations (a broadcast bucket counts once per destination)."""
        return sum(b.data_nbytes * len(b.dsts) for b in self.buckets)

    def arena(self, role: str, rank: int) -> BucketLayout:
        """A layout for ONE buffer holding every tensor of source rank `rank` (role "src": its shards)
        or destination rank `rank` (role "dst": its needs), in which each bucket made of whole tensors
        is one contiguous byte range laid out exactly like the bucket. A sender whose tensors live in
        such a buffer (e.g. the trainer's staging) sends those buckets without packing; a receiver
        given such tensors as `into` receives them without unpacking. Tensors that travel in parts
        follow at the end (they are packed / copied as usual)."""
        if role not in ("src", "dst"):
            raise PlanError(f"role must be 'src' or 'dst', got {role!r}")
        shards = {s.name: s for s in (self.sources[rank] if role == "src" else self.needs[rank])}
        buckets = self.buckets_from(rank) if role == "src" else self.buckets_to(rank)
        placed: dict[str, int] = {}
        cursor = 0
        for b in buckets:
            names = [e.piece.name for e in b.entries]
            if any(n in placed or e.piece.box != shards[n].box for n, e in zip(names, b.entries, strict=True)):
                continue
            base = align_up(cursor, self.alignment)
            for e in b.entries:
                placed[e.piece.name] = base + e.offset
            cursor = base + b.nbytes
        for name in sorted(shards):
            if name not in placed:
                placed[name] = entry_offset(cursor, shards[name].nbytes, self.alignment)
                cursor = placed[name] + shards[name].nbytes
        entries = sorted((BucketEntry(n, shards[n].dtype, shards[n].box.shape, off) for n, off in placed.items()),
                         key=lambda e: e.offset)
        return BucketLayout(tuple(entries), cursor, self.alignment)

    def summary(self) -> dict[str, Any]:
        return {"hash": self.hash, "buckets": len(self.buckets), "bucket_bytes": self.bucket_bytes,
                "num_src": self.num_src, "num_dst": self.num_dst, "bytes": self.total_bytes(),
                "delivered_bytes": self.delivered_bytes()}


# --- the planner ------------------------------------------------------------------------------------------

class _Columns:
    """Output columns of the pieces (tensor id, dim-major offset and shape), grown as blocks arrive: the
    blocks are computed in place here, so nothing is copied to join them."""

    def __init__(self, dims: int, cdt: Any, bound: int) -> None:
        self.bound = bound  # no more pieces than (source rank, destination, tensor) cells
        self.used = 0
        cap = bound if bound <= 1 << 28 else 1 << 24  # untouched capacity costs address space, not memory
        self.t = np.empty(cap, dtype=np.int32)
        self.off = np.empty((dims, cap), dtype=cdt)
        self.shp = np.empty((dims, cap), dtype=cdt)

    def reserve(self, n: int) -> int:
        """Room for n more cells after the used ones; returns where they start."""
        need = self.used + n
        if need > len(self.t):
            cap = min(self.bound, max(need, 2 * len(self.t)))
            for name in ("t", "off", "shp"):
                old = getattr(self, name)
                new = np.empty((*old.shape[:-1], cap), dtype=old.dtype)
                new[..., : self.used] = old[..., : self.used]
                setattr(self, name, new)
        return self.used


_CHUNK = 1 << 22  # (source rank, destination, tensor) cells per intersection block: ~16 MiB per int32 array


@_streamed
def build_plan(
    sources: Sequence[Sequence[TensorShard]] | ShardTable,
    needs: Sequence[Sequence[TensorShard]] | ShardTable,
    bucket_bytes: int,
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> TransferPlan:
    """Compute the plan for moving the tensors described by `sources[src_rank]` to `needs[dst_rank]`.

    Pure and deterministic: the same inputs give the same buckets and the same hash on every agent.
    Source tensors nobody needs are ignored; a needed region no source holds is a PlanError.
    """
    if bucket_bytes < 1:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if alignment < 1:
        raise PlanError(f"alignment must be positive, got {alignment}")
    src = sources if isinstance(sources, ShardTable) else ShardTable.from_lists(sources, "source")
    dst = needs if isinstance(needs, ShardTable) else ShardTable.from_lists(needs, "destination")
    return _plan(src, dst, int(bucket_bytes), int(alignment))


def _first_rank(table: ShardTable, t: int) -> int:
    return table.rank_of(int(np.argmax(table.tensor == t)))


def _check_same_model(S: ShardTable, N: ShardTable, n2s: np.ndarray) -> None:
    common = np.flatnonzero(n2s >= 0)
    if not common.size:
        return
    s_ids = n2s[common]
    bad = (S.ndim[s_ids] != N.ndim[common]) | (S.gshape[s_ids] != N.gshape[common]).any(axis=1)
    bad |= np.array([S.dtypes[a] != N.dtypes[b] for a, b in zip(s_ids.tolist(), common.tolist(), strict=True)])
    if bad.any():
        j = int(np.argmax(bad))
        tn, ts = int(common[j]), int(s_ids[j])
        raise PlanError(
            f"tensor {N.names[tn]!r}: source rank {_first_rank(S, ts)} says {S.dtypes[ts]}{list(S.global_shape(ts))} "
            f"but destination rank {_first_rank(N, tn)} says {N.dtypes[tn]}{list(N.global_shape(tn))}; trainer "
            "and inference must describe the same model"
        )


def _all_dims(a: np.ndarray) -> np.ndarray:
    """[dims, ...] -> whether every dim is > 0 (a loop over the few dims beats a reduction over them)."""
    out = a[0] > 0
    for k in range(1, len(a)):
        out &= a[k] > 0
    return out


def _precedes(aoff: np.ndarray, ashp: np.ndarray, boff: np.ndarray, bshp: np.ndarray) -> np.ndarray:
    """[dims, ...] boxes: whether box a lies wholly before box b along the first dim in which their
    extents differ. A chain of such boxes is pairwise disjoint (FSDP chunks and TP x FSDP grids in rank
    order are such chains)."""
    out = np.zeros(aoff.shape[1:], dtype=bool)
    same = np.ones(aoff.shape[1:], dtype=bool)
    for k in range(len(aoff)):
        ao, bo = aoff[k], boff[k]
        diff = (ao != bo) | (ashp[k] != bshp[k])
        out |= same & diff & (ao + ashp[k] <= bo)
        same &= ~diff
    return out


def _owners(S: ShardTable, soff: np.ndarray, sshp: np.ndarray, ne: np.ndarray) -> np.ndarray:
    """[ranks, tensors]: whether a rank sends its box of a tensor. Every distinct non-empty box has one
    owner, rotated over its replicas by a counter running over (tensor name, box) in sorted order; a
    PlanError if two distinct boxes of a tensor overlap."""
    R, T = ne.shape
    owned = ne.copy()
    if R < 2 or T == 0:
        return owned
    # Fast path: in rank order, each box precedes the next one (no gaps, replicas or overlaps).
    gap = (~ne[:-1] & ne[1:]).any(axis=0)
    chain = _precedes(soff[:, :-1], sshp[:, :-1], soff[:, 1:], sshp[:, 1:])
    hard = np.flatnonzero(gap | (ne[:-1] & ne[1:] & ~chain).any(axis=0))
    if hard.size:
        _owners_sorted(S, soff, sshp, ne, owned, hard)
    return owned


def _owners_sorted(S: ShardTable, soff: np.ndarray, sshp: np.ndarray, ne: np.ndarray, owned: np.ndarray,
                   hard: np.ndarray) -> None:
    r_idx, h_idx = np.nonzero(ne[:, hard])
    t_idx = hard[h_idx]
    off, shp = soff[:, r_idx, t_idx], sshp[:, r_idx, t_idx]
    order = np.lexsort([r_idx, *shp[::-1], *off[::-1], t_idx])  # Box order within a tensor, replicas by rank
    r_idx, t_idx, off, shp = r_idx[order], t_idx[order], off[:, order], shp[:, order]
    dup = (t_idx[1:] == t_idx[:-1]) & (off[:, 1:] == off[:, :-1]).all(axis=0) & (shp[:, 1:] == shp[:, :-1]).all(axis=0)
    starts = np.flatnonzero(np.concatenate([[True], ~dup]))  # first row of each distinct box
    a, b = starts[:-1], starts[1:]
    suspect = (t_idx[a] == t_idx[b]) & ~_precedes(off[:, a], shp[:, a], off[:, b], shp[:, b])
    run_end = np.concatenate([starts[1:], [len(r_idx)]])
    for t in np.unique(t_idx[b][suspect]).tolist():
        k = np.flatnonzero(t_idx[starts] == t)
        ranks = [r_idx[i:j].tolist() for i, j in zip(starts[k].tolist(), run_end[k].tolist(), strict=True)]
        _raise_overlap(S, t, off[:, starts[k]], shp[:, starts[k]], ranks)
    box_t = t_idx[starts]
    counts = ne.sum(axis=0)
    counts[hard] = 0
    counts += np.bincount(box_t, minlength=len(counts))
    before = np.cumsum(counts) - counts
    local = np.arange(len(starts)) - np.searchsorted(box_t, box_t, side="left")
    owner = starts + (before[box_t] + local) % (run_end - starts)
    owned[:, hard] = False
    owned[r_idx[owner], box_t] = True


def _raise_overlap(S: ShardTable, t: int, off: np.ndarray, shp: np.ndarray, ranks: list[list[int]]) -> None:
    """Raise the PlanError for the first overlapping pair of distinct boxes (in Box order), if any."""
    n = off.shape[1]
    hit = np.ones((n, n), dtype=bool)
    for k in range(len(off)):
        end = off[k] + shp[k]
        hit &= np.maximum(off[k][:, None], off[k][None]) < np.minimum(end[:, None], end[None])
    hit = np.triu(hit, k=1)
    if not hit.any():
        return  # disjoint, just not in an order the fast test recognises
    i, j = (int(x) for x in np.argwhere(hit)[0])
    nd = int(S.ndim[t])
    a = Box(tuple(off[:nd, i].tolist()), tuple(shp[:nd, i].tolist()))
    b = Box(tuple(off[:nd, j].tolist()), tuple(shp[:nd, j].tolist()))
    raise PlanError(f"tensor {S.names[t]!r}: source boxes {a} (ranks {ranks[i]}) and {b} (ranks {ranks[j]}) overlap "
                    "without being identical; shards must be disjoint or replicas")


def _merge_broadcast(src: np.ndarray, d: np.ndarray, t: np.ndarray, off: np.ndarray, shp: np.ndarray, Dn: int
                     ) -> tuple[tuple[np.ndarray, ...], list[tuple[int, ...]]]:
    """Pairs (source, destination, tensor, box) of tensors whose needs overlap -> pieces: the pairs of
    one (source, tensor) with equal intersections become one piece for all their destinations. Returns
    (src, group, tensor, off, shp) per piece, group indexing the returned destination tuples."""
    # The pairs come grouped by (source, tensor), destinations ascending within a group.
    idx = np.arange(len(src))
    is_first = np.concatenate([[True], (src[1:] != src[:-1]) | (t[1:] != t[:-1])])
    first = np.flatnonzero(is_first)[np.cumsum(is_first) - 1]
    rep = idx.copy()
    for k in range(1, Dn):  # a (source, tensor) has one pair per destination at most
        cand = np.flatnonzero(idx - k >= first)
        if not cand.size:
            break
        j = cand - k
        same = (off[:, j] == off[:, cand]).all(axis=0) & (shp[:, j] == shp[:, cand]).all(axis=0)
        rep[cand[same]] = j[same]  # the earliest equal pair wins (k grows)
    is_head = rep == idx
    heads = np.flatnonzero(is_head)
    slot = (np.cumsum(is_head) - 1)[rep]
    if Dn <= 52:  # destination sets as bit masks (exact in float64)
        masks = np.bincount(slot, weights=np.ldexp(1.0, d), minlength=len(heads)).astype(np.int64)
        if Dn <= 16:  # few possible sets: count them instead of sorting
            present = np.flatnonzero(np.bincount(masks, minlength=1 << Dn))
            where = np.zeros(1 << Dn, dtype=np.int64)
            where[present] = np.arange(len(present))
            uniq, grp = present, where[masks]
        else:
            uniq, inv = np.unique(masks, return_inverse=True)
            grp = inv.reshape(-1)
        tuples = [tuple(i for i in range(Dn) if int(m) >> i & 1) for m in uniq.tolist()]
    else:
        members: list[list[int]] = [[] for _ in heads]
        for s, dd in zip(slot.tolist(), d.tolist(), strict=True):
            members[s].append(dd)
        ids: dict[tuple[int, ...], int] = {}
        grp = np.array([ids.setdefault(tuple(m), len(ids)) for m in members], dtype=np.int64)
        tuples = list(ids)
    return (src[heads], grp, t[heads], off[:, heads], shp[:, heads]), tuples


def _merge_streams(a: tuple[np.ndarray, np.ndarray, np.ndarray], astream: np.ndarray, alen: np.ndarray,
                   b: tuple[np.ndarray, ...], b_grank: np.ndarray, ng: int, Ts: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Insert the broadcast-merged pieces `b` (src, group, tensor, off, shp) into the stream-ordered
    single-destination pieces `a` (tensor, off, shp; streams `astream` of `alen` pieces). A piece goes
    where its (stream, tensor) key sorts; the pieces of one insertion point are copied as one run, so
    whole broadcast streams between single-destination ones cost a few copies."""
    ten, off, shp = a
    bsrc, bg, bt, boff, bshp = b
    bstream = bsrc.astype(np.int64) * ng + b_grank[bg]
    key = bstream * Ts + bt
    if len(key) > 1 and (key[1:] < key[:-1]).any():
        ob = np.argsort(key, kind="stable")
        bstream, bt, boff, bshp = bstream[ob], bt[ob], boff[:, ob], bshp[:, ob]
    del key
    astart = np.cumsum(alen) - alen
    # where each broadcast piece goes among the others: before every stream of a higher key, and within
    # a stream of its own key (a single destination) before the pieces of higher tensor ids
    si = np.searchsorted(astream, bstream)
    ins = np.where(si < len(astream), astart[np.minimum(si, len(astream) - 1)], len(ten)) if len(astream) else \
        np.zeros(len(bt), dtype=np.int64)
    own = np.flatnonzero((si < len(astream)) & (astream[np.minimum(si, max(len(astream) - 1, 0))] == bstream)) \
        if len(astream) else np.zeros(0, dtype=np.int64)
    for i in own.tolist():  # rare: a shared tensor that is not broadcast to this destination
        s = int(si[i])
        lo, hi = int(astart[s]), int(astart[s] + alen[s])
        ins[i] = lo + int(np.searchsorted(ten[lo:hi], bt[i]))
    cuts = np.flatnonzero(np.diff(ins, prepend=-1, append=len(ten) + 1))  # runs of one insertion point
    P = len(ten) + len(bt)
    out_t = np.empty(P, dtype=ten.dtype)
    out_o = np.empty((off.shape[0], P), dtype=off.dtype)
    out_s = np.empty((off.shape[0], P), dtype=off.dtype)
    pos = a_pos = 0
    for r0, r1 in itertools.pairwise(cuts.tolist()):
        at = int(ins[r0])
        n = at - a_pos  # single-destination pieces before this run
        out_t[pos:pos + n], out_o[:, pos:pos + n], out_s[:, pos:pos + n] = ten[a_pos:at], off[:, a_pos:at], shp[:, a_pos:at]
        pos, a_pos = pos + n, at
        n = r1 - r0
        out_t[pos:pos + n], out_o[:, pos:pos + n], out_s[:, pos:pos + n] = bt[r0:r1], boff[:, r0:r1], bshp[:, r0:r1]
        pos += n
    n = len(ten) - a_pos
    out_t[pos:], out_o[:, pos:], out_s[:, pos:] = ten[a_pos:], off[:, a_pos:], shp[:, a_pos:]
    bs_ids, bs_len = np.unique(bstream, return_counts=True)
    streams, inv = np.unique(np.concatenate([astream, bs_ids]), return_inverse=True)
    lens = np.bincount(inv, weights=np.concatenate([alen, bs_len]), minlength=len(streams)).astype(np.int64)
    return out_t, out_o, out_s, streams // ng, streams % ng, lens


def _split(t: np.ndarray, off: np.ndarray, shp: np.ndarray, big: np.ndarray, mx: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split pieces `big` (of more than mx elements each) into row-major consecutive sub-boxes as
    Box.split does, in place of the piece. Returns (t, off, shp, pieces per original piece)."""
    D, P = shp.shape
    so, ss = off[:, big].astype(np.int64), shp[:, big].astype(np.int64)
    n = len(big)
    suf = np.ones((D, n), dtype=np.int64)  # suf[k] = prod(ss[k+1:])
    for k in range(D - 2, -1, -1):
        suf[k] = suf[k + 1] * ss[k + 1]
    rows = np.arange(n)
    dd = np.argmax(suf <= mx[None, :], axis=0)  # the first dim whose trailing block fits
    step = np.maximum(1, mx // suf[dd, rows])
    pre = np.ones((D + 1, n), dtype=np.int64)
    pre[1:] = np.cumprod(ss, axis=0)
    nch = -(-ss[dd, rows] // step)
    cnt = pre[dd, rows] * nch
    counts = np.ones(P, dtype=np.int64)
    counts[big] = cnt
    rep = np.repeat(np.arange(P), counts)
    t2, off2, shp2 = t[rep], off[:, rep], shp[:, rep]
    js = np.repeat(rows, cnt)
    q = np.arange(len(js)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    c, prefix = q % nch[js], q // nch[js]
    new_off, new_shp, djs = so[:, js], ss[:, js], dd[js]
    for k in range(D - 1, -1, -1):  # unravel the prefix over the dims before the split dim
        inside = k < djs
        sk = ss[k, js]
        new_off[k] += np.where(inside, prefix % sk, 0)
        prefix = np.where(inside, prefix // sk, prefix)
        new_shp[k] = np.where(inside, 1, sk)
    r2 = np.arange(len(js))
    st = step[js]
    new_off[djs, r2] = so[djs, js] + c * st
    new_shp[djs, r2] = np.minimum(st, ss[djs, js] - c * st)
    pos = np.repeat((np.cumsum(counts) - counts)[big], cnt) + q
    off2[:, pos] = new_off
    shp2[:, pos] = new_shp
    return t2, off2, shp2, counts


def _pack(nb: np.ndarray, lens: np.ndarray, bucket_bytes: int, alignment: int
          ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Entry offsets, and buckets as (stream, seq, lo, hi, nbytes) arrays: each stream (`lens[i]`
    consecutive pieces) is packed greedily in order with buckets.entry_offset alignment, a new bucket
    starting where the next entry would not fit (exactly what a loop over the pieces would do)."""
    P, S = len(nb), len(lens)
    starts = np.cumsum(lens) - lens
    ends = starts + lens
    if alignment > SMALL_ALIGNMENT and alignment % SMALL_ALIGNMENT:
        return _pack_slow(nb, starts, ends, bucket_bytes, alignment)
    # Offsets as if streams had no bucket bound. In a stream whose entries all take the same alignment
    # each one starts at the previous start plus its aligned size: a prefix sum. Streams mixing entries
    # of >= alignment bytes with smaller ones (16-byte steps) take the block computation.
    small = min(alignment, SMALL_ALIGNMENT)
    step = nb + (small - 1)
    step //= small
    step *= small
    big: np.ndarray | None = None
    mixed = np.zeros(S, dtype=bool)
    if alignment > small:
        big = nb >= alignment
        nbig = np.add.reduceat(big, starts, dtype=np.int64) if S else np.zeros(0, dtype=np.int64)
        mixed = (nbig > 0) & (nbig < lens)
        if int(nbig.sum()) == P:
            step += alignment - 1
            step //= alignment
            step *= alignment
        elif nbig.any():
            bi = np.flatnonzero(big)
            step[bi] = (step[bi] + alignment - 1) // alignment * alignment
    G = np.cumsum(step)
    G -= step
    del step
    if S <= 4096:  # relative to each stream's start, in place
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            if s:
                G[s:e] -= G[s]
    else:
        G -= np.repeat(G[starts], lens)
    if mixed.any():
        assert big is not None
        ms = np.flatnonzero(mixed)
        idx = np.concatenate([np.arange(starts[i], ends[i]) for i in ms.tolist()])
        G[idx] = _block_offsets(nb[idx], big[idx], lens[ms], alignment)
    e_last = G[ends - 1] + nb[ends - 1]
    fits = e_last <= bucket_bytes
    one = np.flatnonzero(fits)
    cols: list[list[np.ndarray]] = [[one], [np.zeros(len(one), dtype=np.int64)], [starts[one]], [ends[one]],
                                    [e_last[one]]]
    extra: list[tuple[int, int, int, int, int]] = []
    for s_i in np.flatnonzero(~fits).tolist():  # streams of more than one bucket, on local arrays
        s0, e0 = int(starts[s_i]), int(ends[s_i])
        g, n = G[s0:e0].copy(), nb[s0:e0]
        L = e0 - s0
        E = g + n
        if big is not None and mixed[s_i]:
            u = (n + (SMALL_ALIGNMENT - 1)) // SMALL_ALIGNMENT * SMALL_ALIGNMENT
            U = np.cumsum(u) - u
            nxt = np.minimum.accumulate(np.where(big[s0:e0], np.arange(L), L)[::-1])[::-1]
        elif big is not None and not big[s0]:  # only small entries
            U, nxt = g, np.full(L, L)
        else:  # only aligned entries
            U, nxt = g, np.arange(L)
        UE = U + n
        s, seq = 0, 0
        while s < L:
            nbi = min(int(nxt[s]), L)
            hi = nbi
            if nbi > s:  # the small entries before the next aligned one
                hi = s + int(np.searchsorted(UE[s:nbi], bucket_bytes + U[s], side="right"))
                G[s0 + s:s0 + hi] = U[s:hi] - U[s]
            if hi == nbi and nbi < L:
                base = 0 if nbi == s else align_up(int(U[nbi] - U[s]), alignment)
                hi = nbi + int(np.searchsorted(E[nbi:], bucket_bytes - base + g[nbi], side="right"))
                G[s0 + nbi:s0 + hi] = base + g[nbi:hi] - g[nbi]
            extra.append((s_i, seq, s0 + s, s0 + hi, int(G[s0 + hi - 1] + n[hi - 1])))
            seq += 1
            s = hi
    if extra:
        for col, vals in zip(cols, np.array(extra, dtype=np.int64).T, strict=True):
            col.append(vals)
    return G, tuple(np.concatenate(c).astype(np.int64) for c in cols)


def _block_offsets(nb: np.ndarray, big: np.ndarray, lens: np.ndarray, alignment: int) -> np.ndarray:
    """Offsets within their streams (consecutive, `lens` long) of entries mixing aligned (`big`) and
    small ones: an aligned entry starts a block at an aligned offset and the small ones after it follow
    at 16-byte steps (16 divides the alignment), so a block's extent is a prefix sum."""
    P = len(nb)
    starts = np.cumsum(lens) - lens
    U = (nb + (SMALL_ALIGNMENT - 1)) // SMALL_ALIGNMENT * SMALL_ALIGNMENT
    total = int(U.sum())
    U = np.cumsum(U) - U
    head = big.copy()
    head[starts] = True
    bstart = np.flatnonzero(head)
    Ub = U[bstart]
    bal = (np.diff(Ub, append=total) + alignment - 1) // alignment * alignment
    BA = np.cumsum(bal) - bal
    first_block = np.searchsorted(bstart, starts)  # every stream starts a block
    sid = np.zeros(len(bstart), dtype=np.int64)
    sid[first_block[1:]] = 1
    np.cumsum(sid, out=sid)
    return U + np.repeat(BA - BA[first_block][sid] - Ub, np.diff(bstart, append=P))


def _pack_slow(nb: np.ndarray, starts: np.ndarray, ends: np.ndarray, bucket_bytes: int, alignment: int
               ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    off = np.zeros(len(nb), dtype=np.int64)
    rows: list[tuple[int, int, int, int, int]] = []
    sizes = nb.tolist()
    for s_i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        seq, lo, cur = 0, s, 0
        for i in range(s, e):
            o = entry_offset(cur, sizes[i], alignment) if i > lo else 0
            if o + sizes[i] > bucket_bytes:
                rows.append((s_i, seq, lo, i, cur))
                seq, lo, o = seq + 1, i, 0
            off[i] = o
            cur = o + sizes[i]
        rows.append((s_i, seq, lo, e, cur))
    arr = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return off, tuple(np.ascontiguousarray(c) for c in arr.T)


def _plan(S0: ShardTable, N0: ShardTable, bucket_bytes: int, alignment: int) -> TransferPlan:
    D = max(S0.ndim_max, N0.ndim_max)
    S, N = S0.padded(D), N0.padded(D)
    R, Ts, Dn = S.num_ranks, len(S.names), N.num_ranks
    sidx = S.index
    n2s = np.array([sidx.get(n, -1) for n in N.names], dtype=np.int64)
    _check_same_model(S, N, n2s)
    cdt = np.int64 if np.int64 in (S.cdt, N.cdt) else np.int32

    soff, sshp, _ = S.dense  # [dims, ranks, tensors]
    ne = _all_dims(sshp)
    owned = _owners(S, soff, sshp, ne)
    has_src: np.ndarray = np.any(ne, axis=0)

    # Needs, re-indexed by source tensor id: [dims, destinations, tensors].
    noff_n, nshp_n, _ = N.dense
    known = n2s >= 0
    src_ok = np.zeros(len(N.names), dtype=bool)
    src_ok[known] = has_src[n2s[known]]
    missing = _all_dims(nshp_n) & ~src_ok[None, :]
    noff = np.zeros((D, Dn, Ts), dtype=cdt)
    nshp = np.zeros((D, Dn, Ts), dtype=cdt)
    noff[:, :, n2s[known]] = noff_n[:, :, known]
    nshp[:, :, n2s[known]] = nshp_n[:, :, known]
    need = _all_dims(nshp) & has_src[None, :]
    nend = noff + nshp

    # Tensors whose needs overlap between destinations may give broadcast pieces; the others never do.
    shared = np.zeros(Ts, dtype=bool)
    for d1 in range(Dn):
        for d2 in range(d1 + 1, Dn):
            both = need[d1] & need[d2]
            if both.any():
                for k in range(D):
                    both &= np.maximum(noff[k, d1], noff[k, d2]) < np.minimum(nend[k, d1], nend[k, d2])
                shared |= both
    any_shared = bool(shared.any())

    # Every owned source box against every need, a block of source ranks at a time, separately for the
    # tensors whose needs are disjoint (each piece goes to one destination) and the shared ones. The
    # former come out in (source, destination, tensor) order: the plan's order, so a stream is one
    # (source, destination) row of a block and its length is a count. They are computed straight into
    # the output columns and compacted there when some cells are not pieces.
    numel_max = int(np.prod(S.gshape.astype(np.float64), axis=1).max()) if Ts else 0
    vdt = np.int32 if numel_max <= _I32_MAX else np.int64  # an intersection never exceeds its tensor
    cov = np.zeros((Dn, Ts), dtype=np.int64)
    needed = need.any(axis=0)
    cols_a = np.flatnonzero(needed & ~shared).astype(np.int32)
    lens: list[np.ndarray] = []
    parts_b: list[tuple[np.ndarray, ...]] = []

    def columns(cols: np.ndarray) -> tuple[np.ndarray, ...]:
        if len(cols) == Ts:
            return soff, sshp, owned, noff, nend, need
        return soff[:, :, cols], sshp[:, :, cols], owned[:, cols], noff[:, :, cols], nend[:, :, cols], need[:, cols]

    def block(arrays: tuple[np.ndarray, ...], r0: int, r1: int, ok: np.ndarray, gt: np.ndarray, vol: np.ndarray,
              los: list[np.ndarray], exts: list[np.ndarray]) -> bool:
        """Intersect source ranks r0:r1 with every need into los/exts; ok: the cells that are pieces,
        vol: their element counts. False when no cell can be one."""
        so_, ss_, ow_, no_, ne_, nd_ = arrays
        np.logical_and(ow_[r0:r1, None, :], nd_[None], out=ok)
        if not ok.any():
            return False
        for k in range(D):
            so = so_[k, r0:r1, None, :]
            np.maximum(so, no_[k, None], out=los[k])
            np.minimum(so + ss_[k, r0:r1, None, :], ne_[k, None], out=exts[k])
            exts[k] -= los[k]
            np.greater(exts[k], 0, out=gt)
            ok &= gt
        np.multiply(exts[0], ok, out=vol, dtype=vdt)
        for e in exts[1:]:
            np.multiply(vol, e, out=vol, dtype=vdt)
        return True

    Ta = len(cols_a)
    out = _Columns(D, cdt, R * Dn * Ta)
    if Ta:
        arrays = columns(cols_a)
        step = max(1, _CHUNK // max(1, Dn * Ta))
        ok_buf, gt_buf, vol_buf = (np.empty(step * Dn * Ta, dtype=dt) for dt in (bool, bool, vdt))
        cov_a = np.zeros((Dn, Ta), dtype=np.int64)
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            shape = (r1 - r0, Dn, Ta)
            cells = shape[0] * Dn * Ta
            ok, gt, vol = (b[:cells].reshape(shape) for b in (ok_buf, gt_buf, vol_buf))
            pos = out.reserve(cells)
            los = [out.off[k, pos:pos + cells].reshape(shape) for k in range(D)]
            exts = [out.shp[k, pos:pos + cells].reshape(shape) for k in range(D)]
            if not block(arrays, r0, r1, ok, gt, vol, los, exts):
                lens.append(np.zeros(shape[0] * Dn, dtype=np.int64))
                continue
            cov_a += vol.sum(axis=0, dtype=np.int64)
            counts = ok.sum(axis=2)
            lens.append(counts.reshape(-1))
            hits = int(counts.sum())
            out.t[pos:pos + cells].reshape(-1, Ta)[:] = cols_a
            if hits < cells:  # keep the cells that are pieces, in order
                flat = ok.reshape(-1)
                for col in (out.t, *out.off, *out.shp):
                    col[pos:pos + hits] = col[pos:pos + cells][flat]
            out.used = pos + hits
        cov[:, cols_a] = cov_a
        del arrays, ok_buf, gt_buf, vol_buf
    else:
        lens.append(np.zeros(R * Dn, dtype=np.int64))
    # Shared tensors whose needing destinations all need the same box (replicated: norms, biases) give
    # one piece per owned source box, for all of them: one pseudo-destination, nothing to merge.
    repl_pieces: list[tuple[np.ndarray, ...]] = []
    if any_shared:
        cols_s = np.flatnonzero(shared)
        first_d = np.argmax(need[:, cols_s], axis=0)
        same = np.ones(len(cols_s), dtype=bool)
        for k in range(D):
            ref_o, ref_s = noff[k, first_d, cols_s], nshp[k, first_d, cols_s]
            same &= ((noff[k][:, cols_s] == ref_o) & (nshp[k][:, cols_s] == ref_s) | ~need[:, cols_s]).all(axis=0)
        cols_r = cols_s[same].astype(np.int32)
        shared[cols_r] = False
        any_shared = bool(shared.any())
        if len(cols_r):
            fr = first_d[same]
            arrays = (soff[:, :, cols_r], sshp[:, :, cols_r], owned[:, cols_r], noff[:, fr, cols_r][:, None],
                      nend[:, fr, cols_r][:, None], np.ones((1, len(cols_r)), dtype=bool))
            Tr = len(cols_r)
            step = max(1, _CHUNK // Tr)
            cov_r = np.zeros(Tr, dtype=np.int64)
            for r0 in range(0, R, step):
                r1 = min(R, r0 + step)
                shape = (r1 - r0, 1, Tr)
                ok, gt, vol = np.empty(shape, dtype=bool), np.empty(shape, dtype=bool), np.empty(shape, dtype=vdt)
                los = [np.empty(shape, dtype=cdt) for _ in range(D)]
                exts = [np.empty(shape, dtype=cdt) for _ in range(D)]
                if not block(arrays, r0, r1, ok, gt, vol, los, exts):
                    continue
                cov_r += vol.sum(axis=(0, 1), dtype=np.int64)
                bc, _, bt = np.nonzero(ok)
                repl_pieces.append(((bc + r0).astype(np.int32), cols_r[bt], np.stack([x[ok] for x in los]),
                                    np.stack([x[ok] for x in exts])))
            cov[:, cols_r] = np.where(need[:, cols_r], cov_r[None, :], 0)
            del arrays
    if any_shared:  # pairs in (source, tensor, destination) order, merged into broadcast pieces below
        cols_b = np.flatnonzero(shared).astype(np.int32)
        arrays, Tb = columns(cols_b), len(cols_b)
        step = max(1, _CHUNK // max(1, Dn * Tb))
        cov_b = np.zeros((Dn, Tb), dtype=np.int64)
        for r0 in range(0, R, step):
            r1 = min(R, r0 + step)
            shape = (r1 - r0, Dn, Tb)
            ok, gt, vol = np.empty(shape, dtype=bool), np.empty(shape, dtype=bool), np.empty(shape, dtype=vdt)
            los = [np.empty(shape, dtype=cdt) for _ in range(D)]
            exts = [np.empty(shape, dtype=cdt) for _ in range(D)]
            if not block(arrays, r0, r1, ok, gt, vol, los, exts):
                continue
            cov_b += vol.sum(axis=0, dtype=np.int64)
            m = ok.transpose(0, 2, 1)
            bc, bt, bd = np.nonzero(m)
            parts_b.append(((bc + r0).astype(np.int32), bd.astype(np.int32), cols_b[bt],
                            np.stack([x.transpose(0, 2, 1)[m] for x in los]),
                            np.stack([x.transpose(0, 2, 1)[m] for x in exts])))
        cov[:, cols_b] = cov_b
        del arrays

    need_vol = np.ones((Dn, Ts), dtype=np.int64)
    for k in range(D):
        need_vol *= nshp[k]
    need_vol *= need
    short = need & (cov != need_vol)
    if short.any():
        di, ti = (int(x) for x in np.argwhere(short)[0])
        nd = int(S.ndim[ti])
        raise PlanError(
            f"tensor {S.names[ti]!r}: destination rank {di} needs offset={tuple(noff[:nd, di, ti].tolist())} "
            f"shape={tuple(nshp[:nd, di, ti].tolist())} but the sources hold only {int(cov[di, ti])} of its "
            f"{int(need_vol[di, ti])} elements"
        )
    if missing.any():
        ds, tn = np.nonzero(missing)
        items = [f"{N.names[t]!r} (destination rank {d})" for d, t in zip(ds[:5].tolist(), tn[:5].tolist(), strict=True)]
        more = f" and {len(ds) - 5} more" if len(ds) > 5 else ""
        raise PlanError(f"no source rank holds {', '.join(items)}{more}; check names and tied embeddings")
    isz = np.array([itemsize(dt) for dt in S.dtypes], dtype=np.int64)
    mx = bucket_bytes // np.maximum(isz, 1)
    tiny = need & (mx < 1)[None, :]
    if tiny.any():
        ti = int(np.argwhere(tiny)[0][1])
        raise PlanError(f"bucket_bytes={bucket_bytes} is smaller than one element of {S.names[ti]!r} ({S.dtypes[ti]})")

    P = out.used
    ten, off, shp = out.t[:P], out.off[:, :P], out.shp[:, :P]
    del out
    lens_a = np.concatenate(lens) if lens else np.zeros(0, dtype=np.int64)
    sid = np.flatnonzero(lens_a)
    s_len = lens_a[sid].astype(np.int64)

    # Destination groups in tuple order; a stream is (source, group) and streams are in that order.
    groups: set[tuple[int, ...]] = {(d,) for d in range(Dn)}
    b_pieces: tuple[np.ndarray, ...] | None = None
    b_tuples: list[tuple[int, ...]] = []
    if parts_b:
        bs_, bd_, bt_, bo_, bh_ = (np.concatenate(c, axis=-1) for c in zip(*parts_b, strict=True))
        parts_b.clear()
        b_pieces, b_tuples = _merge_broadcast(bs_, bd_, bt_, bo_, bh_, Dn)
    if repl_pieces:  # the group of a replicated tensor's pieces: every destination that needs it
        rs_, rt_, ro_, rh_ = (np.concatenate(c, axis=-1) for c in zip(*repl_pieces, strict=True))
        repl_pieces.clear()
        rts = np.unique(rt_)
        if Dn <= 62:  # destination sets as bit masks: a tuple per distinct set, not per tensor
            bits = (need[:, rts].astype(np.int64) << np.arange(Dn, dtype=np.int64)[:, None]).sum(axis=0)
            umask, inv = np.unique(bits, return_inverse=True)
            sets = [tuple(i for i in range(Dn) if m >> i & 1) for m in umask.tolist()]
        else:
            per_t = [tuple(np.flatnonzero(need[:, t]).tolist()) for t in rts.tolist()]
            sets = sorted(set(per_t))
            inv = np.array([sets.index(s) for s in per_t], dtype=np.int64)
        gidx = {g: i for i, g in enumerate(b_tuples)}
        for g in sorted(set(sets) - set(gidx)):
            gidx[g] = len(b_tuples)
            b_tuples.append(g)
        gid = np.zeros(Ts, dtype=np.int64)
        gid[rts] = np.array([gidx[s] for s in sets], dtype=np.int64)[inv.reshape(-1)]
        rg_ = gid[rt_]
        b_pieces = (rs_, rg_, rt_, ro_, rh_) if b_pieces is None else tuple(
            np.concatenate([x, y], axis=-1) for x, y in zip(b_pieces, (rs_, rg_, rt_, ro_, rh_), strict=True))
    groups.update(b_tuples)
    ordered = sorted(groups)
    grank = {g: i for i, g in enumerate(ordered)}
    ng = len(ordered)
    single = np.array([grank[(d,)] for d in range(Dn)], dtype=np.int64)
    s_src, s_grp = sid // max(Dn, 1), single[sid % max(Dn, 1)] if Dn else sid
    if b_pieces is not None:
        ten, off, shp, s_src, s_grp, s_len = _merge_streams(
            (ten, off, shp), s_src * ng + s_grp, s_len, b_pieces, np.array([grank[g] for g in b_tuples]), ng, Ts)
        P = len(ten)

    # Sizes; pieces bigger than a bucket are split in place.
    numel = shp[0].astype(np.int64)
    for k in range(1, D):
        numel *= shp[k]
    if P and int(numel.max()) > int(mx.min()):
        big = np.flatnonzero(numel > mx[ten])
        if big.size:
            ten, off, shp, counts = _split(ten, off, shp, big, mx[ten[big]])
            s_len = np.add.reduceat(counts, np.cumsum(s_len) - s_len)
            P = len(ten)
            numel = shp[0].astype(np.int64)
            for k in range(1, D):
                numel *= shp[k]
    nb = numel
    nb *= int(isz[0]) if len(isz) and (isz == isz[0]).all() else isz[ten]

    if P:
        entry, (bs, bq, blo, bhi, bnb) = _pack(nb, s_len, bucket_bytes, alignment)
        b_data = np.add.reduceat(nb, blo[np.argsort(blo)]) if len(blo) else blo
        b_data = b_data[np.argsort(np.argsort(blo))]
    else:
        entry = np.zeros(0, dtype=np.int64)
        bs = bq = blo = bhi = bnb = b_data = np.zeros(0, dtype=np.int64)
    del nb, numel
    order = np.lexsort((bs, bq))  # round-robin: every stream's first bucket, then every second one, ...
    bs, blo, bhi, bnb, b_data = bs[order], blo[order], bhi[order], bnb[order], b_data[order]
    b_src, b_grp = s_src[bs], s_grp[bs]

    core = _Core(S, ordered, ten, off, shp, entry, b_src, b_grp, blo, bhi, bnb, b_data)
    h = _hash(S0, N0, core, bucket_bytes, alignment, D)
    buckets = tuple(BucketPlan(i, s, ordered[g], _Entries(core, i), n)
                    for i, (s, g, n) in enumerate(zip(b_src.tolist(), b_grp.tolist(), bnb.tolist(), strict=True)))
    return TransferPlan(_Ranks(S0), _Ranks(N0), buckets, bucket_bytes, alignment, h, core)


def _hash(S: ShardTable, N: ShardTable, core: _Core, bucket_bytes: int, alignment: int, D: int) -> str:
    """SHA-256 over everything that decides which byte goes where: both sides' tables, the destination
    groups, the bucket table, and the per-piece columns (tensor, box, offset in the bucket). The piece
    columns (tens of millions of rows) enter through their XXH3-128 digests: this is a consistency check
    between agents computing the same function, not a MAC, and SHA-256 over a gigabyte takes a second."""
    import xxhash

    h = hashlib.sha256(f"weightsync-plan/{PLAN_FORMAT}|{bucket_bytes}|{alignment}|{D}\n".encode())
    h.update(f"{S.digest}|{N.digest}|{json.dumps(core.groups)}\n".encode())
    for a in (core.b_src, core.b_grp, core.b_lo, core.b_hi, core.b_nbytes):
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    for a in (core.p_tensor, *core.p_off, *core.p_shp, core.p_entry):  # one contiguous column at a time
        arr = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
        h.update(f"|{arr.dtype.str}|{len(arr)}|".encode())
        h.update(xxhash.xxh3_128(arr.data.cast("B") if arr.nbytes else b"").digest())
    return h.hexdigest()


def shards_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorShard]:
    """Whole-tensor shards for plain (unsharded) named tensors: a replicated source or destination."""
    return [TensorShard.full(n, t.dtype, tuple(t.shape)) for n, t in named]
