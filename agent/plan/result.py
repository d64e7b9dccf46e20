"""The computed plan (`TransferPlan`, `BucketPlan`), kept as arrays (`_Core`) and made into objects
lazily: an agent only ever looks at the buckets of the ranks it serves."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, overload

import numpy as np

from weightsync.agent.plan.buckets import BucketEntry, BucketLayout, align_up, entry_offset
from weightsync.agent.plan.table import ShardTable
from weightsync.agent.plan.types import (
    Box,
    Piece,
    PlanError,
    PlannedEntry,
    TensorShard,
    _box,
    _new,
    _rows,
    _shard,
)


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
class ArenaPiece:
    """A region of a source shard that is staged where its bucket of pieces wants it (`at`, a byte offset
    in the arena) instead of inside its whole shard: `offset` / `shape` are its box in the shard's own
    (local) coordinates."""

    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    at: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "offset": list(self.offset), "shape": list(self.shape), "at": self.at}


@dataclass(frozen=True)
class SourceArena:
    """Where a source rank stages its shards (TransferPlan.source_arena): whole shards as `layout`'s
    entries, shards that only travel in pieces as `pieces`; every bucket laid out here is one contiguous
    byte range of the arena, exactly like the bucket, so it is sent from staging without a pack."""

    layout: BucketLayout
    pieces: tuple[ArenaPiece, ...] = ()
    #: shards this plan sends nothing of from this rank: every box of them is another rank's to send (a
    #: data-parallel replica of the same shard owns it). `layout` places them last, from `sent_nbytes` on, so
    #: a trainer may leave them out of staging (`to_dict(skip_unsent=True)`): a version is then staged once
    #: per shard owner, not once per data-parallel replica.
    unsent: tuple[str, ...] = ()
    sent_nbytes: int = -1

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def staged_nbytes(self) -> int:
        """The arena's size without the unsent shards."""
        return self.sent_nbytes if self.unsent else self.layout.nbytes

    def to_dict(self, *, skip_unsent: bool = False) -> dict[str, Any]:
        """The layout a trainer copies its shards in (TrainerSession.publish; `pieces` is read by clients that
        know it: an older client sees a layout that lacks the pieced tensors and packs in publish order).
        `skip_unsent`: the layout without the unsent shards, named in `unsent` (only for a client that said it
        stages owned shards only: an older one would find tensors missing and pack everything in order)."""
        if skip_unsent and self.unsent:
            gone = set(self.unsent)
            d = BucketLayout(tuple(e for e in self.layout.entries if e.name not in gone), self.sent_nbytes,
                             self.layout.alignment).to_dict()
            d["unsent"] = list(self.unsent)
        else:
            d = self.layout.to_dict()
        if self.pieces:
            d["pieces"] = [p.to_dict() for p in self.pieces]
        return d


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

    @cached_property
    def memo(self) -> dict[Any, Any]:
        """What other modules derive from this bucket once per plan instead of once per version (e.g. the
        content digest's piece keys and seeds): a plan's buckets live as long as the plan is cached."""
        return {}

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

    @cached_property
    def memo(self) -> dict[Any, Any]:
        """What endpoints derive from the plan once instead of once per version (a receiver's needs by name and
        piece counts): the plan is immutable and cached for as long as its layout lasts."""
        return {}

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

    def source_arena(self, rank: int) -> SourceArena:
        """The staging layout of source rank `rank` in which EVERY bucket it sends is one contiguous range laid
        out like the bucket (`arena("src")` only places buckets of whole shards): the pieces of a shard that
        travels in pieces (a row-parallel weight under FSDP -> TP) are staged each at its place in its bucket,
        so the trainer's one copy into staging (a strided copy per piece) is also the pack. A shard whose
        planned pieces do not tile it (a region nobody needs, overlapping needs) and buckets that repeat a
        region fall back to `arena("src")`'s rule: the shard is staged whole after the buckets and those
        buckets are packed."""
        shards = {s.name: s for s in self.sources[rank]}
        whole: dict[str, int] = {}
        parts: dict[str, list[tuple[Box, int]]] = {}
        seen: set[tuple[str, Box]] = set()
        cursor = 0
        for b in self.buckets_from(rank):
            if any((e.piece.name, e.piece.box) in seen or e.piece.name in whole
                   or (e.piece.box == shards[e.piece.name].box and e.piece.name in parts) for e in b.entries):
                continue
            base = align_up(cursor, self.alignment)
            for e in b.entries:
                name, box = e.piece.name, e.piece.box
                seen.add((name, box))
                if box == shards[name].box:
                    whole[name] = base + e.offset
                else:
                    parts.setdefault(name, []).append((box, base + e.offset))
            cursor = base + b.nbytes
        pieces: list[ArenaPiece] = []
        for name, got in parts.items():
            shard = shards[name].box
            boxes = [bx for bx, _ in got]
            tiles = sum(bx.numel for bx in boxes) == shard.numel and all(
                a.intersect(c) is None for i, a in enumerate(boxes) for c in boxes[i + 1:])
            if not tiles:
                continue  # staged whole below; its buckets are packed
            for bx, at in got:
                local = tuple(o - so for o, so in zip(bx.offset, shard.offset, strict=True))
                pieces.append(ArenaPiece(name, local, bx.shape, at))
        pieced = {p.name for p in pieces}
        unsent = tuple(n for n in sorted(shards) if n not in whole and n not in parts and shards[n].nbytes)
        staged = [n for n in sorted(shards) if n not in whole and n not in pieced and n not in unsent]
        for i, name in enumerate(staged + list(unsent)):  # the unsent ones last, from sent_nbytes on
            if i == len(staged):
                sent_nbytes = cursor
            whole[name] = entry_offset(cursor, shards[name].nbytes, self.alignment)
            cursor = whole[name] + shards[name].nbytes
        entries = sorted((BucketEntry(n, shards[n].dtype, shards[n].box.shape, off) for n, off in whole.items()),
                         key=lambda e: e.offset)
        return SourceArena(BucketLayout(tuple(entries), cursor, self.alignment), tuple(sorted(pieces, key=lambda p: p.at)),
                           unsent, sent_nbytes if unsent else cursor)

    def summary(self) -> dict[str, Any]:
        return {"hash": self.hash, "buckets": len(self.buckets), "bucket_bytes": self.bucket_bytes,
                "num_src": self.num_src, "num_dst": self.num_dst, "bytes": self.total_bytes(),
                "delivered_bytes": self.delivered_bytes()}
