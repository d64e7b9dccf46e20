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
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from .buckets import (
    DEFAULT_ALIGNMENT,
    BucketEntry,
    BucketLayout,
    align_up,
    dtype_name,
    entry_offset,
    itemsize,
    to_dtype,
)

PLAN_FORMAT = 1


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
        if any(o < 0 for o in self.offset) or any(s < 0 for s in self.shape):
            raise PlanError(f"box offset {self.offset} / shape {self.shape} must be non-negative")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

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
        if len(self.global_shape) != self.box.ndim or not Box.full(self.global_shape).contains(self.box):
            raise PlanError(
                f"tensor {self.name!r}: box offset={self.box.offset} shape={self.box.shape} "
                f"is outside its global shape {self.global_shape}"
            )

    @classmethod
    def full(cls, name: str, dtype: str | torch.dtype, shape: Sequence[int]) -> TensorShard:
        dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return cls(name, dt, tuple(int(s) for s in shape), Box.full(shape))

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


@dataclass(frozen=True)
class BucketPlan:
    """One flattened bucket: its pieces all come from `src` and all go to every rank in `dsts`."""

    index: int
    src: int
    dsts: tuple[int, ...]
    entries: tuple[PlannedEntry, ...]
    nbytes: int

    @property
    def broadcast(self) -> bool:
        """True when more than one destination needs these exact bytes."""
        return len(self.dsts) > 1

    @cached_property
    def layout(self) -> BucketLayout:
        return BucketLayout(tuple(e.bucket_entry for e in self.entries), self.nbytes)


@dataclass(frozen=True)
class TransferPlan:
    """The whole plan. Immutable and identical on every agent that computed it from the same inputs."""

    sources: tuple[tuple[TensorShard, ...], ...]
    needs: tuple[tuple[TensorShard, ...], ...]
    buckets: tuple[BucketPlan, ...]
    bucket_bytes: int
    alignment: int
    hash: str = field(compare=False)

    @property
    def num_src(self) -> int:
        return len(self.sources)

    @property
    def num_dst(self) -> int:
        return len(self.needs)

    def buckets_from(self, src: int) -> list[BucketPlan]:
        """The buckets source rank `src` sends, in plan order."""
        return [b for b in self.buckets if b.src == src]

    def buckets_to(self, dst: int) -> list[BucketPlan]:
        """The buckets destination rank `dst` receives, in plan order."""
        return [b for b in self.buckets if dst in b.dsts]

    def dsts_of(self, src: int) -> list[int]:
        return sorted({d for b in self.buckets_from(src) for d in b.dsts})

    def srcs_of(self, dst: int) -> list[int]:
        return sorted({b.src for b in self.buckets_to(dst)})

    def max_bucket_nbytes(self, *, src: int | None = None, dst: int | None = None) -> int:
        """Largest bucket (optionally only those from `src` / to `dst`): the size of a reusable slot."""
        sizes = [
            b.nbytes for b in self.buckets if (src is None or b.src == src) and (dst is None or dst in b.dsts)
        ]
        return max(sizes, default=0)

    def broadcast_groups(self) -> list[tuple[int, tuple[int, ...]]]:
        """Distinct (src, dsts) sets of broadcast buckets, sorted: transports create one group each."""
        return sorted({(b.src, b.dsts) for b in self.buckets if b.broadcast})

    def total_bytes(self) -> int:
        """Bytes a sender moves (a broadcast bucket counts once)."""
        return sum(b.nbytes for b in self.buckets)

    def delivered_bytes(self) -> int:
        """Bytes that arrive at destinations (a broadcast bucket counts once per destination)."""
        return sum(sum(e.piece.nbytes for e in b.entries) * len(b.dsts) for b in self.buckets)

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


def plan_hash(
    sources: Sequence[Sequence[TensorShard]],
    needs: Sequence[Sequence[TensorShard]],
    buckets: Sequence[BucketPlan],
    bucket_bytes: int,
    alignment: int,
) -> str:
    """SHA-256 over a canonical text rendering of everything that decides which byte goes where."""
    h = hashlib.sha256()
    h.update(f"weightsync-plan/{PLAN_FORMAT}|{bucket_bytes}|{alignment}\n".encode())
    for kind, ranks in (("S", sources), ("D", needs)):
        for r, shards in enumerate(ranks):
            rows = [f"{kind}{r}|{s.name}|{s.dtype}|{s.global_shape}|{s.box.offset}|{s.box.shape}" for s in shards]
            h.update(("\n".join(rows) + "\n").encode())
    for b in buckets:
        rows = [f"B{b.index}|{b.src}|{b.dsts}|{b.nbytes}"]
        rows += [f"{e.offset}|{json.dumps(e.piece.canonical(), separators=(',', ':'))}" for e in b.entries]
        h.update(("\n".join(rows) + "\n").encode())
    return h.hexdigest()


def _check_ranks(kind: str, ranks: Sequence[Sequence[TensorShard]]) -> list[dict[str, TensorShard]]:
    out: list[dict[str, TensorShard]] = []
    for r, shards in enumerate(ranks):
        by_name: dict[str, TensorShard] = {}
        for s in shards:
            if s.name in by_name:
                raise PlanError(f"{kind} rank {r} lists tensor {s.name!r} twice; one box per tensor and rank")
            by_name[s.name] = s
        out.append(by_name)
    return out


def _check_metadata(src: list[dict[str, TensorShard]], dst: list[dict[str, TensorShard]]) -> None:
    seen: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for kind, ranks in (("source", src), ("destination", dst)):
        for r, by_name in enumerate(ranks):
            for name, s in by_name.items():
                where = f"{kind} rank {r}"
                if name not in seen:
                    seen[name] = (s.dtype, s.global_shape, where)
                    continue
                dt, gs, first = seen[name]
                if (dt, gs) != (s.dtype, s.global_shape):
                    raise PlanError(
                        f"tensor {name!r}: {first} says {dt}{list(gs)} but {where} says "
                        f"{s.dtype}{list(s.global_shape)}; trainer and inference must describe the same model"
                    )


def build_plan(
    sources: Sequence[Sequence[TensorShard]],
    needs: Sequence[Sequence[TensorShard]],
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
    src_by = _check_ranks("source", sources)
    dst_by = _check_ranks("destination", needs)
    _check_metadata(src_by, dst_by)

    # Distinct source boxes per tensor and the ranks holding each (replicas).
    holders: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, by_name in enumerate(src_by):
        for name, s in by_name.items():
            if s.box.numel:
                holders[name][s.box].append(r)
    owners: dict[str, list[tuple[Box, int]]] = {}
    counter = 0
    for name in sorted(holders):
        boxes = sorted(holders[name])
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                if a.intersect(b) is not None:
                    raise PlanError(
                        f"tensor {name!r}: source boxes {a} (ranks {holders[name][a]}) and {b} (ranks "
                        f"{holders[name][b]}) overlap without being identical; shards must be disjoint or replicas"
                    )
        owned = []
        for box in boxes:
            ranks = sorted(holders[name][box])
            owned.append((box, ranks[counter % len(ranks)]))
            counter += 1
        owners[name] = owned

    # Intersections, merged across destinations that need identical bytes from the same owner.
    piece_dsts: dict[tuple[str, Box, int, Box], list[int]] = defaultdict(list)
    missing: list[str] = []
    for d, by_name in enumerate(dst_by):
        for name in sorted(by_name):
            need = by_name[name]
            if not need.box.numel:
                continue
            if name not in owners:
                missing.append(f"{name!r} (destination rank {d})")
                continue
            covered = 0
            for box, owner in owners[name]:
                inter = need.box.intersect(box)
                if inter is None:
                    continue
                piece_dsts[(name, inter, owner, box)].append(d)
                covered += inter.numel
            if covered != need.box.numel:
                raise PlanError(
                    f"tensor {name!r}: destination rank {d} needs offset={need.box.offset} shape={need.box.shape} "
                    f"but the sources hold only {covered} of its {need.box.numel} elements"
                )
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise PlanError(f"no source rank holds {', '.join(missing[:5])}{more}; check names and tied embeddings")

    meta = {name: s for by_name in dst_by for name, s in by_name.items()}
    pieces: list[Piece] = []
    for (name, inter, owner, src_box), dl in piece_dsts.items():
        m = meta[name]
        max_numel = bucket_bytes // itemsize(m.dtype)
        if max_numel < 1:
            raise PlanError(f"bucket_bytes={bucket_bytes} is smaller than one element of {name!r} ({m.dtype})")
        for sub in inter.split(max_numel):
            pieces.append(Piece(name, m.dtype, m.global_shape, sub, owner, src_box, tuple(sorted(dl))))
    pieces.sort(key=lambda p: (p.src, p.dsts, p.name, p.box.offset))

    # Pack each (src, dsts) stream into buckets, then interleave streams round-robin so that
    # consecutive buckets involve different pairs and can move concurrently.
    streams: dict[tuple[int, tuple[int, ...]], list[list[PlannedEntry]]] = defaultdict(list)
    cursors: dict[tuple[int, tuple[int, ...]], int] = {}
    for p in pieces:
        key = (p.src, p.dsts)
        cur = cursors.get(key)
        off = entry_offset(cur, p.nbytes, alignment) if cur is not None else 0
        if cur is None or off + p.nbytes > bucket_bytes:
            streams[key].append([])
            off = 0
        streams[key][-1].append(PlannedEntry(p, off))
        cursors[key] = off + p.nbytes
    order = sorted(((seq, key) for key, bl in streams.items() for seq in range(len(bl))))
    buckets: list[BucketPlan] = []
    for index, (seq, key) in enumerate(order):
        entries = tuple(streams[key][seq])
        nbytes = entries[-1].offset + entries[-1].piece.nbytes
        buckets.append(BucketPlan(index, key[0], key[1], entries, nbytes))

    src_t = tuple(tuple(s for _, s in sorted(b.items())) for b in src_by)
    dst_t = tuple(tuple(s for _, s in sorted(b.items())) for b in dst_by)
    h = plan_hash(src_t, dst_t, buckets, bucket_bytes, alignment)
    return TransferPlan(src_t, dst_t, tuple(buckets), bucket_bytes, alignment, h)


def shards_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorShard]:
    """Whole-tensor shards for plain (unsharded) named tensors: a replicated source or destination."""
    return [TensorShard.full(n, t.dtype, tuple(t.shape)) for n, t in named]
