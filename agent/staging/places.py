"""Where an app's tensors sit in a staging segment, on both ends of the client library.

Trainer side: the place the agent's staging layout gives each local shard (`arena_offsets`: whole, in
pieces straight into their buckets, or nowhere when another rank sends it), the tensor index the publish
sends and the views of the segment the shards are copied to (the copy itself: copies.copy_all), kept per layout
(`StagingLayout`, held with the mapped segments by `TrainerStaging`) because they depend only on metadata.
Engine side: the views of a bucket the agent placed
in a segment, kept per layout (`BucketViews`). Every byte is still copied once per version; what is kept is
the per-tensor bookkeeping around the copy (tens of microseconds a tensor, tens of thousands of tensors in
an MoE version). The sessions that use all this are in agent/client.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.layout.shards import LocalShard
from weightsync.agent.plan import buckets
from weightsync.agent.staging import copies, segments
from weightsync.agent.wire import protocol as P

#: where a shard staged in pieces puts each one: (offset in the shard, shape, byte offset in staging)
PiecePlaces = list[tuple[tuple[int, ...], tuple[int, ...], int]]


def arena_offsets(shards: Sequence[LocalShard], layout: Any, size: int) -> list[int | PiecePlaces | None] | None:
    """Where each of `shards` goes in the staging layout the agent asked for (its plan's buckets, so they are
    sent straight from staging): a byte offset for a shard staged whole, or its pieces' places for a shard
    that travels in pieces (`layout["pieces"]`: each is copied to its place in its bucket, so this one copy
    is also the pack), or None for a shard the plan sends from another rank (`layout["unsent"]`: a data-
    parallel replica owns it; it is published by metadata only). None when the layout does not describe
    exactly these tensors (first version, changed model): then they are packed in order and the agent packs
    buckets itself."""
    if not isinstance(layout, dict):
        return None
    try:
        index = {e.name: e for e in buckets.BucketLayout.from_dict(layout).entries}
        pieces: dict[str, PiecePlaces] = {}
        for p in layout.get("pieces") or ():
            pieces.setdefault(str(p["name"]), []).append(
                (tuple(int(x) for x in p["offset"]), tuple(int(x) for x in p["shape"]), int(p["at"])))
        unsent = {str(n) for n in layout.get("unsent") or ()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if set(index) & set(pieces) or unsent & (set(index) | set(pieces)) or \
            set(index) | set(pieces) | unsent != {s.name for s in shards}:
        return None
    out: list[int | PiecePlaces | None] = []
    for s in shards:
        dtype, shape, isz = segments.dtype_name(s.tensor.dtype), tuple(s.tensor.shape), s.tensor.element_size()
        if s.name in unsent:
            out.append(None)
            continue
        if s.name in pieces:
            places = pieces[s.name]
            if any(len(o) != len(shape) or len(n) != len(shape) or at < 0 or at + math.prod(n) * isz > size
                   or any(a < 0 or a + b > d for a, b, d in zip(o, n, shape, strict=True)) for o, n, at in places):
                return None
            if sum(math.prod(n) for _, n, _ in places) != math.prod(shape):
                return None
            out.append(places)
            continue
        e = index[s.name]
        if e.dtype != dtype or e.shape != shape or e.offset + e.nbytes > size:
            return None
        out.append(e.offset)
    return out


def oversubscribed_threads(env: Mapping[str, str] | None = None) -> str | None:
    """Why this rank's copy of CPU tensors into staging may stall, or None. The copy runs on torch's intra-op
    threads (one per core by default); with several ranks on one pod (torchrun's LOCAL_WORLD_SIZE), each
    running one per core, their OpenMP threads spin against each other. Measured with two ranks on two
    cores (bench/agent_pipeline.py --mode ipc --fsdp 2 --inference-tp 2): the copy took up to 2 s instead
    of 0.06 s. torchrun sets OMP_NUM_THREADS=1 per rank unless it is set; this catches the other launchers."""
    env = os.environ if env is None else env
    try:
        local_ranks = int(env.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        return None
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks <= 1 or local_ranks * threads <= cores:
        return None
    return (f"{local_ranks} local ranks x {threads} intra-op threads each > {cores} cores: the copy into staging "
            "runs on those threads and can stall for seconds; launch ranks as torchrun does (OMP_NUM_THREADS=1) "
            f"or set OMP_NUM_THREADS to at most {max(1, cores // local_ranks)}")


ShardKey = tuple[tuple[str, torch.dtype, torch.Size, tuple[int, ...], tuple[int, ...]], ...]


def shard_key(shards: Sequence[LocalShard]) -> ShardKey:
    """What a publish's staging layout depends on in its shards: names, dtypes, shapes and global boxes."""
    return tuple([(s.name, s.tensor.dtype, s.tensor.shape, s.global_shape, s.global_offset) for s in shards])


@dataclass
class ShardsDerived:
    """What a publish derives from its shards' metadata alone: sizes, packed offsets, device and layout key. Kept
    while LocalShardsMemo hands back the very same shards (same tensors, addresses and shapes): at 16,384 tensors,
    working it out again took about 2 us a tensor of every publish."""

    shards: list[LocalShard]
    sizes: list[int]
    offsets: list[int]
    total: int
    device: str
    key: ShardKey

    @classmethod
    def of(cls, shards: list[LocalShard]) -> ShardsDerived:
        sizes = [segments.tensor_nbytes(s.tensor) for s in shards]
        offsets, total = segments.pack_offsets(sizes)
        first_cuda = next((s.tensor for s in shards if s.tensor.is_cuda), None)  # no device object per tensor
        device = "cpu" if first_cuda is None else str(first_cuda.device)
        return cls(shards, sizes, offsets, total, device, shard_key(shards))


@dataclass
class StagingLayout:
    """One publish's places and tensor index, kept for the next publish of the same shards into the same layout.

    Why: an MoE version has tens of thousands of tensors, and the places (arena_offsets: a parse of the agent's
    layout), the index sent with the publish, and the staging views to copy into were rebuilt per tensor and per
    version (about 40 us per tensor). They depend only on the shards' metadata, the layout the agent sent and the
    segment, so they are built once per layout and segment; every publish still copies every byte."""

    layout: Any
    size: int
    key: ShardKey
    places: Sequence[int | PiecePlaces | None]
    metas: list[dict[str, Any]]
    #: segment name -> the staging views each copy writes to (shard order; a shard in pieces: one per piece)
    views: dict[str, list[torch.Tensor]]
    layout_id: str = ""  # the agent's name for `layout` (it then replies `layout_same` instead of sending it)
    index_id: str = ""   # the agent's name for `metas` once it accepted them (a publish then sends the name only)
    #: the copy's sources for the last shards seen (those very objects), and its chunks per thread count
    _sources: tuple[list[LocalShard], list[torch.Tensor]] | None = None
    _chunks: dict[int, copies.Chunks] = field(default_factory=dict)

    def matches(self, layout: Any, size: int, key: ShardKey) -> bool:
        return self.size == size and self.key == key and self.layout == layout

    def sources(self, shards: list[LocalShard]) -> list[torch.Tensor]:
        """What the copy reads, in the order of `views`: each staged shard whole, or its pieces (strided views of
        it, straight to their places in their buckets); nothing of a shard another rank sends. Kept while the same
        shard objects come back (their tensors are the app's own, so the views read what they hold now)."""
        if self._sources is not None and self._sources[0] is shards:
            return self._sources[1]
        srcs: list[torch.Tensor] = []
        for s, place in zip(shards, self.places, strict=True):
            if place is None:  # another rank sends it (this one is a data-parallel replica): not copied
                continue
            if isinstance(place, int):
                srcs.append(s.tensor)
            else:  # each piece straight to its place in its bucket: a strided copy, the only one
                srcs.extend(s.tensor[tuple(slice(o, o + k) for o, k in zip(off, shape, strict=True))]
                            for off, shape, _ in place)
        self._sources, self._chunks = (shards, srcs), {}
        return srcs

    def chunks(self, threads: int) -> copies.Chunks | None:
        """The copy's split for `threads` threads (copies.split_for_threads), once per layout and thread count."""
        if self._sources is None:
            return None
        got = self._chunks.get(threads)
        if got is None:
            got = self._chunks[threads] = copies.split_for_threads([t.nbytes for t in self._sources[1]], threads)
        return got


def index_entry(s: LocalShard, nbytes: int) -> dict[str, Any]:
    """One shard's entry in a publish's tensor index: name, dtype, local shape, global box and size."""
    return {"name": s.name, "dtype": segments.dtype_name(s.tensor.dtype), "shape": list(s.tensor.shape),
            "global_shape": list(s.global_shape), "global_offset": list(s.global_offset), "nbytes": nbytes}


def publish_index(shards: Sequence[LocalShard], places: Sequence[int | PiecePlaces | None],
                  sizes: Sequence[int]) -> list[dict[str, Any]]:
    """The tensor index a staged publish sends: each shard's entry and where it is staged (`offset`; its
    `pieces` for a shard staged in pieces; `unstaged` for a shard another rank sends)."""
    metas = []
    for s, place, n in zip(shards, places, sizes, strict=True):
        meta = index_entry(s, n)
        if place is None:
            meta["unstaged"] = True
        elif isinstance(place, int):
            meta["offset"] = place
        else:
            meta["offset"] = place[0][2]
            meta["pieces"] = [{"offset": list(o), "shape": list(k), "at": at} for o, k, at in place]
        metas.append(meta)
    return metas


def staging_views(seg: segments.Segment, shards: Sequence[LocalShard],
                  places: Sequence[int | PiecePlaces | None]) -> list[torch.Tensor]:
    """The views of `seg` the shards are copied to: one per shard staged whole, one per piece of a shard staged
    in pieces, none for a shard another rank sends. Slices of one typed view of the segment per dtype."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out: list[torch.Tensor] = []
    for s, place in zip(shards, places, strict=True):
        if place is None:
            continue
        dt = s.tensor.dtype
        flat = typed.get(dt)
        if flat is None:
            isz = torch.empty((), dtype=dt).element_size()
            flat = typed[dt] = seg.tensor[: seg.size // isz * isz].view(dt)
        isz = flat.element_size()
        for at, shape in ([(place, tuple(s.tensor.shape))] if isinstance(place, int) else
                          [(at, shape) for _, shape, at in place]):
            n = math.prod(shape)
            if at % isz or at + n * isz > seg.size:
                raise ValueError(f"{s.name}: staging place {at} (+{n * isz} B) is unaligned or outside segment "
                                 f"{seg.name} of {seg.size} B")
            out.append(flat[at // isz: at // isz + n].view(shape))
    return out


class TrainerStaging:
    """A trainer session's side of staging: the segments the agent handed it, kept mapped, and the last
    publish's StagingLayout, reused while the agent's layout, the segment and the shards stay the same. Closed
    as a whole when the agent goes away (its views map that agent's segments)."""

    #: staging segments kept mapped (the agent rotates 2-3 per rank; one it replaced, e.g. by a smaller one once
    #: the plan sends less from this rank, is unmapped here so that its memory is freed)
    KEEP_SEGMENTS = 4

    def __init__(self) -> None:
        self.segments: dict[str, segments.Segment] = {}
        self.layout: StagingLayout | None = None  # the last publish's places, index and views

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        self.layout = None

    def segment(self, handle: dict[str, Any]) -> segments.Segment:
        """The segment of a stage reply, mapped once and kept (most recently used last)."""
        name = str(handle["name"])
        seg = self.segments.pop(name, None)
        if seg is None or seg.size != int(handle["size"]):
            if seg is not None:
                self._forget_views(name)
                seg.close()
            seg = segments.attach_segment(handle)
        self.segments[name] = seg  # most recently used last
        while len(self.segments) > self.KEEP_SEGMENTS:
            old = next(iter(self.segments))
            self._forget_views(old)
            self.segments.pop(old).close()
        return seg

    def _forget_views(self, name: str) -> None:
        """Drop the cached views of a segment this process unmaps (they would keep its memory mapped)."""
        if self.layout is not None:
            self.layout.views.pop(name, None)

    def layout_id(self) -> str | None:
        """The agent's name for the layout held here (a stage request sends it), None when it named none."""
        return self.layout.layout_id if self.layout is not None and self.layout.layout_id else None

    def layout_of(self, reply: Mapping[str, Any]) -> Any:
        """The staging layout of a stage reply: the one held here when the agent says it is the same."""
        lay = self.layout
        if reply.get("layout_same") is True and lay is not None and lay.layout_id and \
                reply.get("layout_id") == lay.layout_id:
            return lay.layout
        return reply.get("layout")

    def arena(self, shards: Sequence[LocalShard], layout: Any, size: int, key: ShardKey
              ) -> list[int | PiecePlaces | None] | None:
        """arena_offsets, or the last publish's places when the layout, segment size and shards are the same."""
        known = self.layout
        if layout is not None and known is not None and known.matches(layout, size, key):
            return list(known.places)
        return arena_offsets(shards, layout, size)

    def prepare(self, seg: segments.Segment, shards: Sequence[LocalShard],
                places: Sequence[int | PiecePlaces | None], sizes: Sequence[int], *, layout: Any,
                key: ShardKey) -> StagingLayout:
        """The publish's tensor index and `seg`'s views for these places: the last ones when nothing changed."""
        known = self.layout
        if known is None or not known.matches(layout, seg.size, key) or \
                list(known.places) != list(places):
            metas = publish_index(shards, places, sizes)
            for name in list(known.views) if known is not None else ():
                self._forget_views(name)
            known = self.layout = StagingLayout(layout, seg.size, key, list(places), metas, {})
        if seg.name not in known.views:
            known.views[seg.name] = staging_views(seg, shards, places)
        return known


class BucketViews:
    """An engine's (name, view) pairs of the buckets the agent places in its staging segments, kept per layout.

    The agent sends the same layouts at the same places every version (its receive slots are kept): a layout
    equal to one already seen in a segment takes the views made then, instead of parsing the index and making
    a view per tensor again (for a bucket of thousands of small tensors that was most of the engine's load
    time). Views map their segment: `forget` a segment before it is unmapped."""

    #: bucket layouts whose views are kept (per agent connection); a version's buckets, a few times over
    KEEP = 1024

    def __init__(self) -> None:
        #: (segment, first offset, entries) or ("id", layout id) -> (segment, layout dict, its views)
        self._held: dict[tuple[Any, ...], tuple[segments.Segment, Any, list[tuple[str, torch.Tensor]]]] = {}

    def _keep(self, key: tuple[Any, ...], value: tuple[segments.Segment, Any, list[tuple[str, torch.Tensor]]]) -> None:
        if len(self._held) >= self.KEEP:
            self._held.clear()
        self._held[key] = value

    def of(self, seg: segments.Segment, layout_dict: Any) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every entry of the bucket the agent placed in `seg` with this layout."""
        entries = layout_dict.get("entries") if isinstance(layout_dict, dict) else None
        first = entries[0].get("offset") if isinstance(entries, list) and entries and isinstance(entries[0], dict) \
            else None
        key = (seg.name, first, len(entries) if isinstance(entries, list) else -1)
        hit = self._held.get(key)
        if hit is not None and hit[0] is seg and hit[1] == layout_dict:
            return list(hit[2])
        layout = buckets.BucketLayout.from_dict(layout_dict)
        if layout.nbytes > seg.size:
            raise ValueError(f"bucket of {layout.nbytes} B does not fit segment {seg.name} ({seg.size} B)")
        pairs = buckets.unpack(seg.tensor, layout)
        self._keep(key, (seg, layout_dict, pairs))
        return list(pairs)

    def by_id(self, seg: segments.Segment, h: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """A bucket whose layout the agent names by id (it sends the layout with the id once, then the id only):
        its views, made when the layout came. An id not held here (evicted, or never sent to this session) is
        refused by name (protocol.LAYOUT_UNKNOWN) and the agent sends the layout again."""
        lid = ("id", str(h["layout_id"]))
        if "layout" in h:
            pairs = self.of(seg, h["layout"])
            self._keep(lid, (seg, None, pairs))
            return pairs
        hit = self._held.get(lid)
        if hit is None or hit[0] is not seg:
            raise ValueError(f"{P.LAYOUT_UNKNOWN}: {lid[1]} in segment {seg.name}")
        return list(hit[2])

    def forget(self, segment_name: str) -> None:
        """Drop the views of a segment that is about to be unmapped (they would keep its memory mapped)."""
        self._held = {k: v for k, v in self._held.items() if v[0].name != segment_name}

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)
