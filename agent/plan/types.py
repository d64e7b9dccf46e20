"""The plan's value types (boxes, shards, pieces) and the helpers every plan module shares: the
bottom layer, so the table, the plan and the planner can all use them without import cycles."""

from __future__ import annotations

import functools
import importlib
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from weightsync.agent.plan.buckets import BucketEntry, dtype_name, itemsize, to_dtype

PLAN_FORMAT = 3  # 3: whole source shards in buckets of their own; 2: columnar hash; 1: a text rendering


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
