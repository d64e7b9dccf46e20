"""Trainer side of the agent: stage what the local trainer publishes, announce it, serve it to inference agents.

Staging: each local trainer rank writes its shards once into a segment from a reusable pool
(agent/staging/segments.py) and tells the agent their metadata; a version is complete when every local rank
published it. The newest `keep` complete versions stay staged (plus any version a transfer is reading or
that an inference agent pinned by asking for its metadata), so training continues while versions are
served and a late inference agent can still pull the current one.

Serving: inference agents open control links (announcements, metadata) and per-version transfer links;
for each source rank the server waits until every destination of the plan joined, then runs a
WeightSender (agent/transfer/sync.py) over the replica's transport. A bad peer never takes the server down:
every link is handled in its own thread and every failure is logged and counted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.plan import Box, SourceArena, TensorShard, TransferPlan
from weightsync.agent.plan.buckets import SMALL_ALIGNMENT, itemsize
from weightsync.agent.staging import segments
from weightsync.agent.staging.ring import RingError, RingStaging
from weightsync.agent.transfer.digest import HASHED_HERE, DigestHooks, SentLeaves
from weightsync.agent.transfer.groups import epoch_of
from weightsync.agent.transfer.relay import FANOUT_GATHER_S, chain_links
from weightsync.agent.transfer.sync import ShardPieces, SyncError, WeightSender
from weightsync.agent.transfer.verify import ChecksumHooks
from weightsync.agent.transports.base import Transport, WorldMap
from weightsync.agent.wire import protocol as P
from weightsync.agent.wire.link import (
    AuthError,
    FrameError,
    Link,
    LinkError,
    LinkListener,
    LinkTimeout,
    Mailbox,
)
from weightsync.crds.topology import InferenceReplicaTopology, Topology

log = logging.getLogger(__name__)

PIN_SECONDS = 60.0           # how long a metadata request keeps a version staged for the transfer to follow
RENDEZVOUS_TIMEOUT = 60.0    # how long a source waits for every destination of a plan to join
ASKING_WINDOW_S = 30.0       # fanOut Relay: a replica that asked for a version's metadata this recently fetches it
PLAN_MEMORY_VERSIONS = 3     # a plan that read none of a rank's last 3 versions no longer holds its staging whole


class StagingError(ValueError):
    """A publish from the local trainer is inconsistent; the message says what to fix in the trainer."""


class PublishedIndex:
    """A rank's validated tensor index (what its publish said about each shard), shared by every version that
    publishes the same one into a segment of the same size.

    Why: a trainer publishes the same index every version; an MoE model's has tens of thousands of entries, and
    checking it, turning it into shards, comparing those with a plan and encoding them for the metadata reply
    cost tens of microseconds per tensor per version. The checks run once per distinct index, the rest is kept
    here."""

    def __init__(self, metas: list[dict[str, Any]], segment_size: int) -> None:
        self.metas = metas
        self.segment_size = segment_size
        #: what a trainer of this release names this index by in its next publish instead of sending it again
        self.id = uuid.uuid4().hex[:16]
        self.nbytes = sum(int(m["nbytes"]) for m in metas)
        self.staged_nbytes = sum(int(m["nbytes"]) for m in metas if m.get("unstaged") is not True)
        self._shards: list[TensorShard] | None = None
        #: plan hashes whose sources for this rank were found equal to these shards (WeightServer._send)
        self.plans_checked: set[str] = set()

    def shards(self) -> list[TensorShard]:
        if self._shards is None:
            self._shards = [TensorShard.of(m["name"], m["dtype"], m["global_shape"], m["global_offset"], m["shape"])
                            for m in self.metas]
        return self._shards


@dataclass
class RankStage:
    rank: int
    slot: segments.Slot | None  # None: streamed through a ring (agent/staging/ring.py), nothing staged here
    metas: list[dict[str, Any]]
    snapshot_bytes: int = 0    # streamed: the trainer's snapshot of the rank's shards (0: none, held)
    #: the content digest's piece hashes of these bytes, per plan hash: computed by the first transfer, sent by
    #: every later one (the other replicas) without hashing again (DigestHooks.sent_leaves)
    leaves: dict[str, SentLeaves] = field(default_factory=dict)
    index: PublishedIndex | None = None  # the validated index `metas` is (shared with earlier versions)

    @property
    def streamed(self) -> bool:
        return self.slot is None

    def shards(self) -> list[TensorShard]:
        if self.index is not None:
            return list(self.index.shards())
        return [TensorShard.of(m["name"], m["dtype"], m["global_shape"], m["global_offset"], m["shape"])
                for m in self.metas]

    @property
    def unstaged(self) -> set[str]:
        """Shards published by metadata only: the plan the trainer staged for sends them from another rank."""
        return {str(m["name"]) for m in self.metas if m.get("unstaged") is True}

    def tensors(self, keep: bool = False) -> dict[str, torch.Tensor | ShardPieces]:
        """Each staged shard as a view of staging, or as its pieces where it was staged in pieces.

        `keep`: the views are kept with the slot for the next version staged in it with the same index (made
        per tensor, tens of thousands per MoE version); they go with the slot. Not over IPC: a colocated pod's
        receiver hands this very memory to its engine and refuses to release it while another view of it is
        alive (agent/transports/ipc.py)."""
        slot = self.slot
        assert slot is not None, "a streamed rank has no staged tensors"
        kept = slot.__dict__.get("views")
        if keep and self.index is not None and kept is not None and kept[0] is self.index and \
                kept[1] is slot.segment.tensor:
            views = kept[2]
        else:
            views = _staged_views(slot.segment, self.metas)
            slot.__dict__["views"] = (self.index, slot.segment.tensor, views) if keep and self.index is not None \
                else None
        return {name: v if isinstance(v, torch.Tensor) else ShardPieces(v[0], v[1], v[2])
                for name, v in views.items()}


StagedView = torch.Tensor | tuple[torch.dtype, list[int], dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]]


def _staged_views(seg: segments.Segment, metas: list[dict[str, Any]]) -> dict[str, StagedView]:
    """Each staged shard of `metas` as a view of `seg`, or (dtype, shape, its pieces' views): slices of one typed
    view of the segment per dtype (Segment.view per tensor made four tensor ops each; tens of thousands per MoE
    version)."""
    typed: dict[str, Callable[[int, list[int]], torch.Tensor]] = {}

    def view_of(dtype: str) -> Callable[[int, list[int]], torch.Tensor]:
        got = typed.get(dtype)
        if got is None:
            dt = segments.dtype_from_name(dtype)
            isz = itemsize(dtype)
            flat = seg.tensor[: seg.size // isz * isz].view(dt)

            def got(at: int, shape: list[int]) -> torch.Tensor:
                n = math.prod(shape)
                if at % isz or at < 0 or at + n * isz > seg.size:
                    return seg.view(at, dt, shape)  # unaligned or outside: its checks say so
                return flat[at // isz: at // isz + n].view(shape)

            typed[dtype] = got
        return got

    out: dict[str, StagedView] = {}
    for m in metas:
        if m.get("unstaged") is True:
            continue
        view = view_of(m["dtype"])
        if m.get("pieces"):
            out[m["name"]] = (segments.dtype_from_name(m["dtype"]), m["shape"],
                              {(tuple(p["offset"]), tuple(p["shape"])): view(int(p["at"]), p["shape"])
                               for p in m["pieces"]})
        else:
            out[m["name"]] = view(int(m["offset"]), m["shape"])
    return out


@dataclass
class StagedVersion:
    version: int
    ranks: dict[int, RankStage] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    readers: int = 0
    pinned_until: float = 0.0
    complete: bool = False
    staged_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(r.index.nbytes if r.index is not None else sum(int(m["nbytes"]) for m in r.metas)
                   for r in self.ranks.values())

    @property
    def staged_nbytes(self) -> int:
        """Bytes copied into staging (shards another rank sends are published by metadata only)."""
        return sum(r.index.staged_nbytes if r.index is not None else
                   sum(int(m["nbytes"]) for m in r.metas if m.get("unstaged") is not True) for r in self.ranks.values())

    @property
    def streamed(self) -> bool:
        """Streamed through a ring (agent/staging/ring.py): the trainer processes hold the bytes, not staging."""
        return any(r.streamed for r in self.ranks.values())


def validate_stream_metas(metas: Any) -> list[dict[str, Any]]:
    """Check a streamed publish's tensor index (no offsets: nothing is staged at publish time)."""
    if not isinstance(metas, list):
        raise StagingError("publish_stream needs a 'tensors' list")
    names: set[str] = set()
    for m in metas:
        try:
            shard = TensorShard.of(m["name"], m["dtype"], m["global_shape"], m["global_offset"], m["shape"])
            n = int(m["nbytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StagingError(f"bad tensor entry {m!r}: {exc}") from None
        if shard.name in names:
            raise StagingError(f"tensor {shard.name!r} published twice in one version")
        names.add(shard.name)
        if n != shard.nbytes:
            raise StagingError(f"tensor {shard.name!r}: nbytes={n} but its dtype/shape need {shard.nbytes}")
    return list(metas)


def validate_metas(metas: Any, segment_size: int) -> list[dict[str, Any]]:
    """Check a publish's tensor index before anything trusts it (the trainer is local but may be buggy)."""
    if not isinstance(metas, list):
        raise StagingError("publish needs a 'tensors' list")
    names: set[str] = set()
    regions: list[tuple[int, int, str]] = []  # (offset, nbytes, tensor) of every staged byte range
    for m in metas:
        try:
            shard = TensorShard.of(m["name"], m["dtype"], m["global_shape"], m["global_offset"], m["shape"])
            unstaged = m.get("unstaged") is True  # metadata only: another rank sends this shard's bytes
            off, n = (-1, int(m["nbytes"])) if unstaged else (int(m["offset"]), int(m["nbytes"]))
            pieces = None if unstaged else _pieces_of(shard, m.get("pieces"))
        except (KeyError, TypeError, ValueError) as exc:
            raise StagingError(f"bad tensor entry {m!r}: {exc}") from None
        if shard.name in names:
            raise StagingError(f"tensor {shard.name!r} published twice in one version")
        names.add(shard.name)
        if n != shard.nbytes:
            raise StagingError(f"tensor {shard.name!r}: nbytes={n} but its dtype/shape need {shard.nbytes}")
        if not unstaged:
            regions.extend(pieces if pieces is not None else [(off, n, shard.name)])
    end = 0
    for off, n, name in sorted(regions):
        if off < end or off + n > segment_size or off % (segments.ALIGN if n >= segments.ALIGN else SMALL_ALIGNMENT):
            raise StagingError(f"tensor {name!r}: bytes [{off}, {off + n}) overlap, are unaligned or "
                               f"leave the {segment_size}-byte segment")
        end = off + n
    return list(metas)


def _pieces_of(shard: TensorShard, pieces: Any) -> list[tuple[int, int, str]] | None:
    """The byte ranges of a shard staged in pieces (TransferPlan.source_arena), after checking that the
    pieces' boxes tile the shard exactly; None for a shard staged whole. Raises ValueError."""
    if pieces is None:
        return None
    if not isinstance(pieces, list) or not pieces:
        raise ValueError("'pieces' must be a non-empty list")
    full = Box.full(shard.box.shape)
    boxes = []
    out = []
    for p in pieces:
        box = Box(tuple(int(x) for x in p["offset"]), tuple(int(x) for x in p["shape"]))
        if box.ndim != full.ndim or not full.contains(box) or not box.numel:
            raise ValueError(f"piece {box} is not a non-empty part of the shard {full}")
        boxes.append(box)
        out.append((int(p["at"]), box.numel * itemsize(shard.dtype), shard.name))
    if sum(b.numel for b in boxes) != full.numel or any(
            a.intersect(c) is not None for i, a in enumerate(boxes) for c in boxes[i + 1:]):
        raise ValueError("the pieces do not tile the shard")
    return out


class StagingStore:
    """Versions the local trainer ranks published, keyed by version; thread-safe."""

    def __init__(self, ranks: list[int], prefix: str, *, keep: int = 1,
                 on_complete: Callable[[StagedVersion], None] | None = None,
                 ring: RingStaging | None = None) -> None:
        self.ranks = sorted(ranks)
        #: ring mode (agent/staging/ring.py): versions are streamed through `ring` instead of staged whole
        self.ring = ring
        self._dropped: list[StagedVersion] = []  # streamed versions evicted: their trainers are told to forget them
        self._streams: dict[tuple[int, int], str] = {}  # (rank, version) -> session of a stream stage request
        self.prefix = prefix
        self.keep = max(1, keep)
        self.on_complete = on_complete
        self._pools: dict[str, segments.SegmentPool] = {}
        self._versions: dict[int, StagedVersion] = {}
        self._pending: dict[tuple[int, int], segments.Slot] = {}  # (rank, version) -> slot being written
        self._lock = threading.Condition()
        # Trainer epoch (see contract.ANN_PUBLISHED_EPOCH): bumped when a new trainer process publishes a
        # version that does not increase. `floor`: the last version published before this agent started
        # (from its own proven pod annotation), so a restarted agent still recognises a restarted trainer.
        self.trainer_epoch = 0
        self.floor: int | None = None
        self._rank_sessions: dict[int, str] = {}  # rank -> the trainer session that staged its last version
        self._retired: list[StagedVersion] = []  # old-epoch versions still being read
        # rank -> (plan hash, arena): where the last plan that read this rank wants each tensor, so the next
        # publish lays its staging out like the buckets and they are sent from staging without a pack
        self._arenas: dict[int, tuple[str, SourceArena]] = {}
        # rank -> {plan hash: the newest version it read}: a rank read by one plan stages only the shards that
        # plan sends from it (data-parallel replicas: once per shard owner); two plans (e.g. IPC groups that
        # reach different trainer pods) may pick different owners, so such a rank stages every shard. A plan
        # that read none of the last PLAN_MEMORY_VERSIONS versions (replaced: bucketSizeMB or membership
        # changed) no longer counts, so the rank goes back to staging its own shards only.
        self._plans_of: dict[int, dict[str, int]] = {}
        self._indexes: dict[int, PublishedIndex] = {}  # rank -> the index of its last publish (PublishedIndex)
        self._layout_dicts: dict[int, tuple[str, dict[str, Any]]] = {}  # rank -> (layout id, its layout dict)

    def prefer_arena(self, rank: int, plan: TransferPlan, version: int | None = None) -> None:
        """Remember the source arena of `plan` for `rank` (computed once per plan), and that `plan` read
        `version` of it (None: the newest version any plan read)."""
        with self._lock:
            plans = self._plans_of.setdefault(rank, {})
            v = version if version is not None else max(plans.values(), default=0)
            plans[plan.hash] = max(v, plans.get(plan.hash, v))
            newest = max(plans.values())
            for h in [h for h, last in plans.items() if last <= newest - PLAN_MEMORY_VERSIONS]:
                del plans[h]
            known = self._arenas.get(rank)
            if known is not None and known[0] == plan.hash:
                return
        arena = plan.source_arena(rank)
        with self._lock:
            self._arenas[rank] = (plan.hash, arena)

    def missing_for(self, rs: RankStage, plan: TransferPlan) -> set[str]:
        """The shards `plan` sends from rank `rs.rank` that were published by metadata only (the trainer staged
        for another plan, which sends them from another rank): such a version cannot be sent under `plan`."""
        if not rs.unstaged:
            return set()
        with self._lock:
            known = self._arenas.get(rs.rank)
        arena = known[1] if known is not None and known[0] == plan.hash else plan.source_arena(rs.rank)
        return rs.unstaged - set(arena.unsent)

    def stage_request(self, rank: int, version: int, nbytes: int, device: str, session: str = "",
                      stream: bool = False, skip_unsent: bool = False, known_layout: Any = None) -> dict[str, Any]:
        """The agent's answer to a trainer's stage request: a segment to copy into and, once a plan read this
        rank, the layout to copy in (its plan arena: the buckets are then sent from staging, no pack). In
        ring mode, to a client that can stream (`stream`): no segment, the ring's depth (agent/staging/ring.py).
        `skip_unsent`: the client stages only the shards the layout lists (it names the others `unsent` and
        publishes them by metadata only), so the segment is the arena without them.

        `known_layout`: the `layout_id` of the layout the client holds from an earlier reply; the same layout is
        then not sent again (`layout_same`: an MoE model's layout is megabytes of JSON). `index`: the id of the
        rank's last published index (PublishedIndex), which the client may publish by id."""
        if self.ring is not None and stream:
            self._check_version(rank, version, session)
            with self._lock:
                self._streams[(rank, version)] = session
            return {"ring": {"depth": self.ring.depth}}
        arena = self.arena(rank)
        with self._lock:
            one_plan = len(self._plans_of.get(rank, ())) == 1
        compact = skip_unsent and one_plan and arena is not None and bool(arena.unsent)
        if compact:
            assert arena is not None
            size = arena.staged_nbytes
        else:
            size = max(nbytes, arena.nbytes if arena else 0)
        seg = self.stage(rank, version, size, device, session=session)
        with self._lock:
            index = self._indexes.get(rank)
            plan_hash = self._arenas[rank][0] if rank in self._arenas else ""
        out: dict[str, Any] = {"segment": seg.handle(), **({"index": index.id} if index is not None else {})}
        if arena is None:
            return out
        lid = f"{plan_hash}/{int(compact)}"
        if known_layout == lid:
            return {**out, "layout_id": lid, "layout_same": True}
        with self._lock:
            cached = self._layout_dicts.get(rank)
        if cached is None or cached[0] != lid:
            cached = (lid, arena.to_dict(skip_unsent=compact))
            with self._lock:
                self._layout_dicts[rank] = cached
        return {**out, "layout_id": lid, "layout": cached[1]}

    def make_spare(self, rank: int, version: int) -> None:
        """`version` of `rank` was served: make the segment its next version will be copied into now, in the
        background (segments.SegmentPool.make_spare), sized as the next stage request will ask. Not for a rank
        whose plan stages only part of it (a data-parallel replica): that size depends on the client."""
        arena = self.arena(rank)
        if arena is not None and arena.unsent:
            return
        with self._lock:
            sv = self._versions.get(version)
            rs = sv.ranks.get(rank) if sv is not None else None
            slot = rs.slot if rs is not None else None
            if slot is None:
                return
            pool = next((p for p in self._pools.values() if slot in p._slots), None)
        if pool is not None:
            pool.make_spare(max(slot.segment.size, arena.nbytes if arena is not None else 0), user=rank)

    def arena(self, rank: int) -> SourceArena | None:
        """The staging layout the next publish of `rank` should use (None until a plan read the rank)."""
        with self._lock:
            known = self._arenas.get(rank)
            return known[1] if known is not None else None

    def resume(self, epoch: int, published: int | None) -> None:
        """Continue from what this pod's agent published before a restart."""
        with self._lock:
            self.trainer_epoch = max(self.trainer_epoch, epoch)
            self.floor = published

    def _pool(self, device: str) -> segments.SegmentPool:
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = segments.SegmentPool(f"{self.prefix}-stage", device)
        return pool

    def latest(self) -> int | None:
        with self._lock:
            done = [v for v, s in self._versions.items() if s.complete]
            return max(done) if done else None

    def stage(self, rank: int, version: int, nbytes: int, device: str, session: str = "") -> segments.Segment:
        self._check_version(rank, version, session)
        if nbytes < 0:
            raise StagingError(f"nbytes must be >= 0, got {nbytes}")
        slot = self._pool(device).acquire(nbytes, user=rank)
        with self._lock:
            old = self._pending.pop((rank, version), None)
            self._pending[(rank, version)] = slot
        if old is not None:
            self._release_slot(old)
        return slot.segment

    def _check_version(self, rank: int, version: int, session: str) -> None:
        """Refuse a rank this agent does not serve and a version that does not increase (or start a new
        trainer epoch: a new trainer session publishing from a lower version)."""
        if rank not in self.ranks:
            raise StagingError(f"rank {rank} is not served by this agent (its ranks are {self.ranks}); "
                               "pass TrainerSession(rank=...) matching the topology")
        with self._lock:
            done = [v for v, sv in self._versions.items() if sv.complete]
            newest = max([*done, *([self.floor] if self.floor is not None else [])], default=None)
            if newest is not None and version <= newest:
                before = self._rank_sessions.get(rank)
                if not session or before == session:
                    raise StagingError(f"version {version} is not newer than the staged version {newest}; "
                                       "versions must increase")
                self._new_epoch(f"rank {rank} publishes version {version} after {newest} from a new trainer "
                                f"session {session[:12]} (was {(before or 'unknown')[:12]})")
            if session:
                self._rank_sessions[rank] = session

    def publish(self, rank: int, version: int, segment: str, metas: Any, aliases: dict[str, str],
                index_id: Any = None) -> StagedVersion:
        """A rank's staged version: its tensor index is `metas`, or, from a client of this release that published
        the same index before (`index_id`, given by the stage reply), the rank's last index."""
        with self._lock:
            slot = self._pending.get((rank, version))
            if slot is None or slot.segment.name != segment:
                raise StagingError(f"publish of version {version} rank {rank} without a matching stage request")
        if metas is None and index_id is not None:
            with self._lock:
                last = self._indexes.get(rank)
            if last is None or last.id != index_id or last.segment_size != slot.segment.size:
                raise StagingError(f"{P.INDEX_UNKNOWN}: publish of version {version} rank {rank} names tensor index "
                                   f"{index_id}, which this agent does not hold for a segment of this size")
            index = last
        else:
            index = self._index_of(rank, metas, slot.segment.size)
        with self._lock:
            del self._pending[(rank, version)]
            sv = self._versions.setdefault(version, StagedVersion(version))
            old = sv.ranks.get(rank)
            sv.ranks[rank] = RankStage(rank, slot, index.metas, index=index)
            sv.aliases.update(aliases)
            for pool in self._pools.values():
                if slot in pool._slots:
                    pool.fill(slot, version)
            newly = not sv.complete and all(r in sv.ranks for r in self.ranks)
            if newly:
                sv.complete = True
                self._evict()
            self._lock.notify_all()
        if old is not None and old.slot is not None:
            self._release_slot(old.slot)
        self._notify_dropped()
        if newly and self.on_complete:
            self.on_complete(sv)
        return sv

    def _index_of(self, rank: int, metas: Any, segment_size: int) -> PublishedIndex:
        """The validated index of a publish: the rank's last one when the trainer sent the same index for a segment
        of the same size (the same checks would pass), else `metas` checked now (validate_metas)."""
        with self._lock:
            last = self._indexes.get(rank)
        if last is not None and last.segment_size == segment_size and last.metas == metas:
            return last
        index = PublishedIndex(validate_metas(metas, segment_size), segment_size)
        with self._lock:
            self._indexes[rank] = index
        return index

    def publish_stream(self, rank: int, version: int, metas: Any, aliases: dict[str, str],
                       snapshot_bytes: int = 0) -> StagedVersion:
        """A rank's version in ring mode: its metadata only (the trainer process keeps the bytes and fills
        the ring of each transfer, agent/staging/ring.py); complete once every local rank published it."""
        if self.ring is None:
            raise StagingError("publish_stream: this agent stages whole versions (WEIGHTSYNC_STAGING is not ring)")
        metas = validate_stream_metas(metas)
        with self._lock:
            if (rank, version) not in self._streams:
                raise StagingError(f"publish_stream of version {version} rank {rank} without a matching stage request")
            del self._streams[(rank, version)]
            sv = self._versions.setdefault(version, StagedVersion(version))
            old = sv.ranks.get(rank)
            sv.ranks[rank] = RankStage(rank, None, metas, snapshot_bytes=max(0, int(snapshot_bytes)))
            sv.aliases.update(aliases)
            newly = not sv.complete and all(r in sv.ranks for r in self.ranks)
            if newly:
                sv.complete = True
                self._evict()
            self._lock.notify_all()
        if old is not None and old.slot is not None:
            self._release_slot(old.slot)
        self._notify_dropped()
        if newly and self.on_complete:
            self.on_complete(sv)
        return sv

    def withdraw(self, version: int) -> bool:
        """A held streamed version whose trainer returned from publish: it is no longer available (transfers
        still reading it fail at their next fill). True when it was staged."""
        with self._lock:
            sv = self._versions.pop(version, None)
            if sv is not None:  # announced already: never published again with other bytes
                self.floor = max(self.floor or 0, version)
        if sv is None:
            return False
        for rs in sv.ranks.values():
            if rs.slot is not None:
                self._release_slot(rs.slot)
        log.info("segments.withdraw version=%s", version)
        return True

    def withdraw_rank(self, rank: int) -> list[int]:
        """Withdraw every version `rank` streams (its trainer process closed its stream connection: nobody
        holds those bytes any more). Returns the versions withdrawn."""
        with self._lock:
            gone = [v for v, sv in self._versions.items() if (rs := sv.ranks.get(rank)) is not None and rs.streamed]
        for v in gone:
            self.withdraw(v)
        return gone

    def snapshot_bytes(self) -> int:
        """The trainer processes' snapshots of the streamed versions this agent keeps."""
        with self._lock:
            return sum(rs.snapshot_bytes for sv in self._versions.values() for rs in sv.ranks.values())

    def _notify_dropped(self) -> None:
        """Tell the trainer processes which streamed versions were evicted (outside the lock)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        if self.ring is None:
            return
        for sv in dropped:
            ring = self.ring
            threading.Thread(target=ring.drop, args=(sv.version, sorted(sv.ranks)), daemon=True,
                             name=f"ring-drop-{sv.version}").start()

    def _new_epoch(self, why: str) -> None:
        """A restarted trainer: every version of the old epoch is dropped (transfers still reading one keep
        their slot until they finish), and versions count from the new trainer's first one (lock held)."""
        self.trainer_epoch += 1
        self.floor = None
        old = list(self._versions.values())
        pending = list(self._pending.values())
        self._versions.clear()
        self._pending.clear()
        for sv in old:
            if sv.readers:  # released when its last transfer ends (reading())
                self._retired.append(sv)
                continue
            self._forget(sv)
        for slot in pending:
            self._release_slot(slot)
        log.warning("trainer epoch %s starts: %s; dropped versions %s", self.trainer_epoch, why,
                    sorted(sv.version for sv in old))

    def _forget(self, sv: StagedVersion) -> None:
        """Release a dropped version's staging (lock held); a streamed one is dropped by its trainers."""
        for rs in sv.ranks.values():
            if rs.slot is not None:
                self._release_slot(rs.slot)
        if sv.streamed:
            self._dropped.append(sv)

    def _release_slot(self, slot: segments.Slot) -> None:
        for pool in self._pools.values():
            if slot in pool._slots:
                pool.release(slot)

    def _evict(self) -> None:
        """Drop complete versions beyond the newest `keep` unless read or pinned (lock held)."""
        now = time.monotonic()
        complete = sorted((v for v, s in self._versions.items() if s.complete), reverse=True)
        keep = set(complete[: self.keep])
        for v in complete[self.keep :]:
            sv = self._versions[v]
            if v in keep or sv.readers or sv.pinned_until > now:
                continue
            del self._versions[v]
            self._forget(sv)
            log.info("segments.evict version=%s", v)
        # incomplete versions older than the newest complete one will never complete usefully
        for v in [v for v, s in self._versions.items() if not s.complete and complete and v < complete[0]]:
            self._forget(self._versions.pop(v))

    def get(self, version: int, *, pin: float = 0.0) -> StagedVersion | None:
        with self._lock:
            sv = self._versions.get(version)
            if sv is None or not sv.complete:
                return None
            if pin:
                sv.pinned_until = max(sv.pinned_until, time.monotonic() + pin)
            return sv

    @contextlib.contextmanager
    def reading(self, version: int) -> Iterator[StagedVersion]:
        with self._lock:
            sv = self._versions.get(version)
            if sv is None or not sv.complete:
                raise StagingError(f"version {version} is not staged here (latest {self.latest()})")
            sv.readers += 1
        try:
            yield sv
        finally:
            with self._lock:
                sv.readers -= 1
                sv.pinned_until = 0.0
                if not sv.readers and any(r is sv for r in self._retired):
                    self._retired = [r for r in self._retired if r is not sv]
                    self._forget(sv)
                self._evict()
            self._notify_dropped()

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
            self._versions.clear()
        if self.ring is not None:
            self.ring.close()


def loading_pods(replica: InferenceReplicaTopology, full_tensors: bool) -> list[str]:
    """The pods of an inference replica whose agents load weights into the engine: every pod, or for an
    engine that takes full tensors over HTTP (SGLang, vLLM) only the pod holding the replica's rank 0."""
    if full_tensors:
        return [m.name for m in replica.pods if 0 in m.ranks]
    return [m.name for m in replica.pods]


@dataclass(frozen=True)
class FleetServed:
    """What each inference replica serves, as reported to this trainer agent by the inference agents."""

    replicas: dict[int, int | None]              # replica -> the version all its loading pods serve (None: not yet)
    pods: dict[int, dict[str, int | None]]       # replica -> loading pod -> the version its agent last reported
    epochs: dict[int, int] = field(default_factory=dict)  # replica -> the trainer epoch of its version

    def reaches(self, version: int, trainer_epoch: int = 0, only_serving: bool = False) -> bool:
        """Every inference replica serves `version` of `trainer_epoch` or newer, in (epoch, version) order
        (true when the topology has no replica): a replica still on an older trainer epoch does not count.
        `only_serving`: replicas that serve nothing (pod gone, agent restarting, engine not loaded yet) are
        left out, but at least one replica must serve it (an RL loop goes on while a replica is replaced)."""
        replicas = {r: v for r, v in self.replicas.items() if v is not None} if only_serving else self.replicas
        if only_serving and not replicas:
            return False
        return all(v is not None and (self.epochs.get(r, 0), v) >= (trainer_epoch, version)
                   for r, v in replicas.items())

    @property
    def version(self) -> int | None:
        """The lowest version served by every replica (None while some replica serves nothing)."""
        return P.lowest_served(self.replicas)

    def to_dict(self) -> dict[str, Any]:
        return {"replicas": [{"replica": r, "served": v, "pods": self.pods.get(r, {})}
                             for r, v in sorted(self.replicas.items())],
                "served_version": self.version}


class ServedTracker:
    """Which version each inference agent committed, from its ws.served reports on its control link.

    Only authenticated inference agents (job token) report, and only versions they committed themselves, so
    nothing an app container writes counts. A report is bound to the link it came on: a new link from the
    same pod (a restarted agent, or a reconnect, after which the agent reports again) replaces it, and a
    closed link drops it. Thread-safe; `wait` wakes on every report."""

    def __init__(self) -> None:
        self._links: dict[str, int] = {}  # pod -> its newest control link
        self._reports: dict[str, tuple[int, int] | None] = {}  # pod -> (epoch, version) on that link (None: withdrawn)
        self._cond = threading.Condition()

    def link_opened(self, pod: str, key: int) -> None:
        """A new control link from `pod`: what it reported on an older link no longer counts."""
        with self._cond:
            self._links[pod] = key
            self._reports.pop(pod, None)
            self._cond.notify_all()

    def link_closed(self, pod: str, key: int) -> None:
        with self._cond:
            if self._links.get(pod) == key:
                del self._links[pod]
                self._reports.pop(pod, None)
                self._cond.notify_all()

    def report(self, pod: str, key: int, version: int | None, trainer_epoch: int = 0) -> None:
        with self._cond:
            if self._links.get(pod) == key:  # a late frame from a replaced link is ignored
                self._reports[pod] = None if version is None else (trainer_epoch, version)
                self._cond.notify_all()

    def fleet(self, topo: Topology, full_tensors: bool) -> FleetServed:
        with self._cond:
            reports = dict(self._reports)
        replicas: dict[int, int | None] = {}
        epochs: dict[int, int] = {}
        pods: dict[int, dict[str, int | None]] = {}
        for rep in topo.inference:
            keys = {name: reports.get(name) for name in loading_pods(rep, full_tensors)}
            pods[rep.replica] = {name: k[1] if k else None for name, k in keys.items()}
            low = None if not keys or any(k is None for k in keys.values()) else min(k for k in keys.values() if k)
            replicas[rep.replica] = low[1] if low else None
            if low:
                epochs[rep.replica] = low[0]
        return FleetServed(replicas, pods, epochs)

    def wait(self, version: int, timeout: float, topo: Callable[[], Topology], full_tensors: bool,
             cancelled: Callable[[], bool] = lambda: False,
             trainer_epoch: Callable[[], int] = lambda: 0, only_serving: bool = False) -> tuple[bool, FleetServed]:
        """Block until every inference replica of the current topology (with `only_serving`, every one that
        serves something, at least one) serves `version` (of the current trainer epoch) or newer, at most
        `timeout` s (or until `cancelled()`); returns (reached, what is served)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            state = self.fleet(topo(), full_tensors)
            if state.reaches(version, trainer_epoch(), only_serving):
                return True, state
            remaining = deadline - time.monotonic()
            if remaining <= 0 or cancelled():
                return False, state
            with self._cond:
                self._cond.wait(min(remaining, 0.5))  # also re-reads the topology (scaled replicas)


TransportFor = Callable[[int, str, WorldMap], Transport]


@dataclass
class _Rendezvous:
    plan: TransferPlan
    version: int
    src: int
    expected: set[int]
    peers: dict[int, Mailbox] = field(default_factory=dict)
    proposals: dict[int, str] = field(default_factory=dict)
    group: dict[str, Any] = field(default_factory=dict)
    started: bool = False
    created: float = field(default_factory=time.monotonic)
    replica: int = -1
    pods: set[str] = field(default_factory=set)  # the pods the destination links came from (their hello)
    relay_ok: bool = True  # every destination offered to relay (fanOut Relay, and its last fetch did not fail)

    @property
    def relay_pod(self) -> str | None:
        """The one pod holding every destination of this source, which can then forward all its buckets."""
        return next(iter(self.pods)) if self.relay_ok and len(self.pods) == 1 else None


class WeightServer:
    """Accepts control and transfer links from inference agents and serves staged versions."""

    def __init__(self, *, host: str, port: int, token: bytes, pod: str, store: StagingStore,
                 transport_for: Callable[[dict[str, Any], TransferPlan, str], tuple[Transport, WorldMap | None]],
                 metrics: AgentMetrics, mode: str, generation: Callable[[], int], verify: bool = False,
                 device: str = "cpu", timeout: float = 600.0, fan_out: bool = False,
                 replicas: Callable[[], int] | None = None) -> None:
        self.verify = verify
        #: spec.transfer.fanOut Relay: replicas fetching a version together are chained (agent/transfer/relay.py)
        self.fan_out = fan_out
        self.replicas = replicas or (lambda: 0)
        self._fans: dict[tuple[int, int, str], list[_Rendezvous]] = {}
        self._fan_cond = threading.Condition()
        # replicas that asked for a version's metadata lately, by version: those about to fetch it, so the
        # fan-out waits for them only (a Rolling wave of one replica is sent to at once)
        self._asking: dict[int, dict[int, float]] = {}
        self.device = torch.device(device)
        self.pod = pod
        self.store = store
        self.transport_for = transport_for
        self.metrics = metrics
        self.mode = mode
        self.generation = generation
        self.timeout = timeout
        self.session = uuid.uuid4().hex[:12]
        self.listener = LinkListener(host, port, token)
        self.port = self.listener.port
        self._subs: dict[int, Link] = {}
        self.served = ServedTracker()
        self._subs_lock = threading.Lock()
        self._rdv: dict[tuple[Any, ...], _Rendezvous] = {}
        self._rdv_lock = threading.Lock()
        self._failures: dict[str, int] = {}
        #: the last metadata reply: (its ranks' indexes, aliases, payload) (_meta_payload)
        self._meta_cache: tuple[tuple[tuple[int, PublishedIndex], ...], dict[str, str], bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ws-accept", daemon=True)
        metrics.rejected_connections.set_function(lambda: self.listener.rejected)

    def start(self) -> WeightServer:
        self._thread.start()
        log.info("weight server listening port=%s ranks=%s", self.port, self.store.ranks)
        return self

    def _accept_loop(self) -> None:
        self.listener.serve(self._handle, self._stop, "ws-peer")

    def _reject(self, link: Link, reason: str, exc: BaseException) -> None:
        self.metrics.rejected_frames.labels(reason).inc()
        log.warning("peer.reject peer=%s reason=%s error=%s", link.peer, reason, exc)
        link.close()

    def _handle(self, link: Link) -> None:
        try:
            header, payload = link.recv(timeout=30)
            kind = header.get("kind")
            if kind == P.HELLO:
                self._control(link, header)
            elif kind == P.TRANSFER:
                self._transfer(link, header, payload)
            else:
                raise P.ProtocolError(f"first frame must be {P.HELLO} or {P.TRANSFER}, got {kind!r}")
        except AuthError as exc:
            self._reject(link, "auth", exc)
        except FrameError as exc:
            self._reject(link, "malformed", exc)
        except P.ProtocolError as exc:
            with contextlib.suppress(LinkError):
                link.send({"kind": P.ERROR, "message": str(exc)})
            self._reject(link, "protocol", exc)
        except LinkError as exc:
            log.info("peer.closed peer=%s: %s", link.peer, exc)
            link.close()
        except Exception:
            log.exception("peer handler failed peer=%s", link.peer)
            link.close()

    # --- control links ------------------------------------------------------------------------------
    def _control(self, link: Link, hello: dict[str, Any]) -> None:
        key = id(link)
        pod = hello.get("pod") if isinstance(hello.get("pod"), str) else None
        with self._subs_lock:
            self._subs[key] = link
        log.info("peer.hello peer=%s pod=%s replica=%s", link.peer, hello.get("pod"), hello.get("replica"))
        if pod is not None:
            self.served.link_opened(pod, key)  # the agent reports what it serves again on this link
        try:
            link.send({"kind": P.WELCOME, "pod": self.pod, "ranks": self.store.ranks, "latest": self.store.latest(),
                       "generation": self.generation(), "session": self.session,
                       "trainer_epoch": self.store.trainer_epoch})
            while not self._stop.is_set():
                try:
                    header, _ = link.recv(timeout=1.0)
                except LinkTimeout:
                    continue
                try:
                    if header.get("kind") == P.SERVED:
                        self._served_report(link, pod, header)
                    else:
                        self._control_request(link, header, hello)
                except P.ProtocolError as exc:
                    self.metrics.rejected_frames.labels("protocol").inc()
                    log.warning("peer.bad_request peer=%s error=%s", link.peer, exc)
                    link.send({"kind": P.ERROR, "id": header.get("id"), "message": str(exc)})
        finally:
            with self._subs_lock:
                self._subs.pop(key, None)
            if pod is not None:
                self.served.link_closed(pod, key)

    def _served_report(self, link: Link, pod: str | None, h: dict[str, Any]) -> None:
        version = P.require(h, "version", int)
        if pod is None:
            raise P.ProtocolError("a served report on a control link whose hello named no pod")
        if version < 0:
            raise P.ProtocolError(f"a served report needs a version >= 1 (or 0: serves no complete version), got {version}")
        epoch = h.get("trainer_epoch", 0)
        if not isinstance(epoch, int) or epoch < 0:
            raise P.ProtocolError(f"a served report's trainer_epoch must be an integer >= 0, got {epoch!r}")
        # 0 withdraws the pod's report: its engine holds no complete version (a failed load and restore)
        self.served.report(pod, id(link), version if version >= 1 else None, epoch)
        log.debug("peer.served pod=%s version=%s", pod, version)

    def _control_request(self, link: Link, h: dict[str, Any], hello: dict[str, Any] | None = None) -> None:
        kind = h.get("kind")
        if kind == P.META_REQ:
            rid = P.require(h, "id", int)
            version = P.require(h, "version", int)
            replica = (hello or {}).get("replica")
            if self.fan_out and isinstance(replica, int):
                self._note_asking(version, replica)
            sv = self.store.get(version, pin=PIN_SECONDS)
            if sv is None:
                link.send({"kind": P.META, "id": rid, "version": version, "ok": False, "latest": self.store.latest(),
                           "error": f"version {version} is not staged on {self.pod}"})
                return
            payload = self._meta_payload(sv)
            link.send({"kind": P.META, "id": rid, "version": version, "ok": True}, payload)
        else:
            raise P.ProtocolError(f"unknown request kind {kind!r} on a control link")

    def _meta_payload(self, sv: StagedVersion) -> bytes:
        """The metadata reply of a staged version: encoded once per set of rank indexes and aliases (an MoE
        model's shard table took tens of milliseconds to encode, per version and per replica asking)."""
        key = tuple(sorted((r, rs.index) for r, rs in sv.ranks.items() if rs.index is not None))
        cached = self._meta_cache
        if len(key) == len(sv.ranks) and cached is not None and cached[0] == key and cached[1] == sv.aliases:
            return cached[2]
        payload = P.encode_meta({r: rs.shards() for r, rs in sv.ranks.items()}, sv.aliases)
        if len(key) == len(sv.ranks):
            self._meta_cache = (key, dict(sv.aliases), payload)
        return payload

    def announce(self, version: int, trainer_epoch: int = 0) -> None:
        with self._subs_lock:
            subs = list(self._subs.values())
        for link in subs:
            try:
                link.send({"kind": P.ANNOUNCE, "version": version, "trainer_epoch": trainer_epoch})
            except LinkError as exc:
                log.info("announce failed peer=%s: %s", link.peer, exc)

    # --- transfer links -----------------------------------------------------------------------------
    def _transfer(self, link: Link, h: dict[str, Any], payload: memoryview) -> None:
        version = P.require(h, "version", int)
        src = P.require(h, "src", int)
        dst = P.require(h, "dst", int)
        group = P.require(h, "group", dict)
        plan_hash = P.require(h, "plan_hash", str)
        proposal = P.require(h, "proposal", str)
        if src not in self.store.ranks:
            raise P.ProtocolError(f"source rank {src} is not served by {self.pod} (ranks {self.store.ranks})")
        key = (version, src, plan_hash, str(group.get("name")), group.get("generation"))
        inputs = P.recv_transfer_inputs(link, h, payload)  # all its parts, before the Mailbox reads the link
        mb = Mailbox(link, name=f"dst{dst}@{link.peer}")
        plan = P.transfer_plan(h, inputs)  # cached per inputs; a key-only link waits for a sibling's inputs
        run: _Rendezvous | None = None
        with self._rdv_lock:
            self._expire()
            rdv = self._rdv.get(key)
            if rdv is None:
                if plan.hash != plan_hash:
                    mb.abort(f"plan mismatch: {self.pod} computed {plan.hash}, the destination sent {plan_hash}")
                    raise P.ProtocolError(f"plan hash mismatch for version {version} (ours {plan.hash}, theirs {plan_hash})")
                rdv = self._rdv[key] = _Rendezvous(plan, version, src, set(plan.dsts_of(src)), group=dict(group))
            if dst not in rdv.expected:
                mb.abort(f"destination rank {dst} receives nothing from source rank {src} in this plan")
                raise P.ProtocolError(f"dst {dst} not in plan for src {src}")
            old = rdv.peers.get(dst)
            if old is not None:  # the destination retried: the new link replaces the old one
                old.close()
            rdv.peers[dst] = mb
            rdv.proposals[dst] = proposal
            pod = h.get("pod")
            rdv.pods.add(pod if isinstance(pod, str) and pod else link.peer)
            rdv.relay_ok = rdv.relay_ok and h.get("relay") is True
            replica = h.get("replica")
            rdv.replica = replica if isinstance(replica, int) else -1
            if set(rdv.peers) == rdv.expected and not rdv.started:
                rdv.started = True
                del self._rdv[key]
                run = rdv
        if run is not None:
            self._dispatch(run)

    # --- fan-out (spec.transfer.fanOut Relay, agent/transfer/relay.py) --------------------------------------------
    def _note_asking(self, version: int, replica: int) -> None:
        now = time.monotonic()
        with self._fan_cond:
            for v in [v for v, who in self._asking.items() if max(who.values()) < now - ASKING_WINDOW_S]:
                del self._asking[v]
            if version not in self._asking and len(self._asking) >= 64:  # requests for many versions at once:
                return  # not a fetch in progress (a client probing); the fan-out just waits for fewer replicas
            self._asking.setdefault(version, {})[replica] = now

    def _fetching(self, version: int) -> int:
        """How many replicas are about to fetch `version` (asked for its metadata within ASKING_WINDOW_S)."""
        now = time.monotonic()
        with self._fan_cond:
            return sum(1 for t in self._asking.get(version, {}).values() if t >= now - ASKING_WINDOW_S)

    def _dispatch(self, rdv: _Rendezvous) -> None:
        """Send to `rdv`'s replica, or, with Relay, chain the replicas whose transfers of the same version,
        source rank and plan complete within FANOUT_GATHER_S: the first is sent to, the others forward."""
        if not self.fan_out or rdv.relay_pod is None:
            self._send(rdv)
            return
        key = (rdv.version, rdv.src, rdv.plan.hash)
        with self._fan_cond:
            fan = self._fans.get(key)
            if fan is not None:  # another thread gathers this fan-out: it chains this replica too
                fan.append(rdv)
                self._fan_cond.notify_all()
                return
            fan = self._fans[key] = [rdv]
            deadline = time.monotonic() + FANOUT_GATHER_S
            want = min(self.replicas(), max(1, self._fetching(rdv.version)))  # the condition's lock is an RLock
            while len(fan) < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._fan_cond.wait(left)
            del self._fans[key]
        chain = sorted(fan, key=lambda r: r.replica)  # the same order for every source rank
        if len(chain) == 1:
            self._send(rdv)
            return
        gname = str(rdv.group.get("name"))
        links = chain_links(
            [(r.group, r.relay_pod or "", list(r.proposals.values())) for r in chain],
            lambda props: epoch_of(self.session, rdv.src, props, self._failures.get(gname, 0)))
        log.info("serve.fan_out version=%s src=%s chain=%s", rdv.version, rdv.src, [r.relay_pod for r in chain])
        for member, (relay_from, relay_to) in zip(chain[1:], links[1:], strict=True):
            self._redirect(member, relay_from, relay_to)
        self._send(chain[0], relay_to=links[0][1])

    def _redirect(self, rdv: _Rendezvous, relay_from: dict[str, Any], relay_to: dict[str, Any] | None) -> None:
        """Tell a chained replica to take this source's buckets from the replica before it (and pass them to
        the one after it); this source sends it nothing."""
        extra = {"relay_from": relay_from, **({"relay_to": relay_to} if relay_to else {})}
        for mb in rdv.peers.values():
            try:
                mb.send(P.EPOCH, src=rdv.src, epoch="relay", **extra)
            except LinkError as exc:
                log.info("serve.redirect_failed version=%s src=%s peer=%s: %s", rdv.version, rdv.src, mb.name, exc)
            mb.close()
        self.metrics.versions.labels("relayed").inc()

    def _expire(self) -> None:
        now = time.monotonic()
        for key, rdv in list(self._rdv.items()):
            if now - rdv.created > RENDEZVOUS_TIMEOUT:
                del self._rdv[key]
                for mb in rdv.peers.values():
                    mb.abort(f"not every destination of version {rdv.version} joined within {RENDEZVOUS_TIMEOUT:.0f}s")
                    mb.close()

    def _send(self, rdv: _Rendezvous, relay_to: dict[str, Any] | None = None) -> None:
        t0 = time.perf_counter()
        gname = str(rdv.group.get("name"))
        epoch = epoch_of(self.session, rdv.src, list(rdv.proposals.values()), self._failures.get(gname, 0))
        extra = {"relay_to": relay_to} if relay_to else {}
        try:
            for mb in rdv.peers.values():
                mb.send(P.EPOCH, src=rdv.src, epoch=epoch, **extra)
            with self.store.reading(rdv.version) as sv:
                rs = sv.ranks.get(rdv.src)
                if rs is None:
                    raise StagingError(f"rank {rdv.src} has no shards in version {rdv.version}")
                if rs.index is None or rdv.plan.hash not in rs.index.plans_checked:
                    mine = {s.name: s for s in rs.shards()}
                    theirs = {s.name: s for s in rdv.plan.sources[rdv.src]}
                    if mine != theirs:
                        raise StagingError(f"the destination's plan describes source rank {rdv.src} differently "
                                           f"from what was staged for version {rdv.version}")
                    if rs.index is not None:  # the same index against the same plan: the same answer
                        rs.index.plans_checked.add(rdv.plan.hash)
                if not rs.streamed:
                    # every local rank learns the plan's arena, also one the plan sends nothing from (a data-
                    # parallel replica whose shards another rank sends: it then stages nothing at all)
                    for r in self.store.ranks:
                        if r < rdv.plan.num_src:
                            self.store.prefer_arena(r, rdv.plan, rdv.version)
                    missing = self.store.missing_for(rs, rdv.plan)
                    if missing:
                        raise StagingError(
                            f"version {rdv.version}: trainer rank {rdv.src} staged only the shards another plan "
                            f"sends from it, and plan {rdv.plan.hash[:12]} also needs {len(missing)} others from it "
                            f"({', '.join(sorted(missing)[:3])}...); with two plans reading this rank, the next "
                            "version is staged whole")
                # transfers of different replicas run concurrently (each replica has its own groups):
                # serialising them per agent could deadlock two trainer pods serving two replicas.
                transport, world = self.transport_for({**rdv.group, "epoch": epoch}, rdv.plan, f"src{rdv.src}")
                digest = DigestHooks(inner=ChecksumHooks() if self.verify else None,
                                     sent_leaves=rs.leaves.setdefault(rdv.plan.hash, SentLeaves()),
                                     hashed_here=HASHED_HERE if transport.name == "ipc" else None)
                sender = WeightSender(rdv.plan, rdv.src, transport, rdv.peers, timeout=self.timeout,
                                      world=world, device=self.device, hooks=digest)
                if rs.streamed:
                    stats = self._send_streamed(rdv, transport, sender)
                else:
                    assert rs.slot is not None
                    seg = rs.slot.segment
                    if isinstance(seg, segments.ShmSegment) and callable(getattr(transport, "register_shared", None)):
                        transport.register_shared(str(seg.path), seg.tensor)  # IPC hands buckets out of staging
                    stats = sender.send_version(rdv.version, rs.tensors(keep=transport.name != "ipc"))
                    self.store.make_spare(rdv.src, rdv.version)  # the next version's segment, faulted in now
        except (SyncError, StagingError, LinkError, RingError) as exc:
            self._failures[gname] = self._failures.get(gname, 0) + 1
            self.metrics.versions.labels("serve_failed").inc()
            log.warning("serve.failed version=%s src=%s error=%s", rdv.version, rdv.src, exc)
            for mb in rdv.peers.values():
                mb.abort(str(exc))
            return
        finally:
            for mb in rdv.peers.values():
                mb.close()
        took = time.perf_counter() - t0
        self.metrics.transfer_bytes.labels("sent", self.mode).inc(stats.bytes)
        self.metrics.copied_bytes.labels("pack").inc(stats.copied_bytes)
        self.metrics.digest_bytes.labels("sent", "hashed").inc(digest.stats.bytes)
        self.metrics.digest_bytes.labels("sent", "reused").inc(digest.stats.reused_bytes)
        self.metrics.serve_seconds.labels(self.mode).observe(took)
        self.metrics.versions.labels("served").inc()
        log.info("serve.done version=%s src=%s dsts=%s bytes=%s seconds=%.3f", rdv.version, rdv.src,
                 sorted(rdv.peers), stats.bytes, took)

    def _send_streamed(self, rdv: _Rendezvous, transport: Transport, sender: WeightSender) -> Any:
        """Ring mode: stream the version through a ring of bucket slots the trainer process fills
        (agent/staging/ring.py); the ring goes back to the pool when the transfer ends, also when it fails."""
        ring = self.store.ring
        if ring is None:
            raise StagingError(f"version {rdv.version} was streamed but this agent has no ring")
        with ring.source(rdv.plan, rdv.src, rdv.version, self.timeout) as source:
            seg = source.segment
            if isinstance(seg, segments.ShmSegment) and callable(getattr(transport, "register_shared", None)):
                transport.register_shared(str(seg.path), seg.tensor)  # IPC hands buckets out of the ring
            try:
                return sender.send_version(rdv.version, {}, stream=source)
            finally:
                # the trainer's copy into the ring: the one copy per byte (and per transfer) of ring mode
                self.metrics.copied_bytes.labels("publish").inc(source.filled_bytes)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        with self._subs_lock:
            for link in self._subs.values():
                link.close()

