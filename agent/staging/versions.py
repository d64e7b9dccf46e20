"""The versions the local trainer ranks staged, kept until the inference agents have fetched them (StagedVersions).

Each local trainer rank writes its shards once into a segment from a reusable pool (agent/staging/segments.py)
and tells the agent their metadata (agent/staging/index.py checks it); a version is complete when every local
rank published it. The newest `keep` complete versions stay staged (plus any version a transfer is reading or
that an inference agent pinned by asking for its metadata), so training continues while versions are served
and a late inference agent can still pull the current one. In ring mode (agent/staging/ring.py) a version is
its metadata only: the trainer processes keep the bytes and fill a ring per transfer. The weight server
(agent/transfer/serve.py) reads versions from here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.hashing import HashedLeaves
from weightsync.agent.plan import SourceArena, TensorShard, TransferPlan
from weightsync.agent.staging import segments
from weightsync.agent.staging.index import (
    PublishedIndex,
    ShardPieces,
    StagedTensors,
    StagedView,
    StagingError,
    staged_views,
    validate_metas,
    validate_stream_metas,
)
from weightsync.agent.staging.ring import BucketRing
from weightsync.agent.wire import protocol as P

log = logging.getLogger(__name__)

PLAN_MEMORY_VERSIONS = 3     # a plan that read none of a rank's last 3 versions no longer holds its staging whole


class SentLeaves:
    """The leaves of one staged version and plan, by (bucket index, algorithm), shared by every transfer that
    sends it (one per replica, concurrent or one after the other, and retries): the first to reach a bucket
    hashes it, the others take its leaves, waiting for them while it hashes, instead of hashing the same bytes
    again (one gate per key, as agent/plan/cache.py builds a plan once). Hashing waits on nothing, so a wait
    ends; a transfer that failed while hashing leaves the bucket to the next one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[tuple[int, str], HashedLeaves] = {}
        self._gates: dict[tuple[int, str], threading.Lock] = {}

    def get_or_compute(self, key: tuple[int, str],
                       compute: Callable[[], HashedLeaves]) -> tuple[HashedLeaves, bool]:
        """The leaves of `key` and whether another transfer computed them (False: `compute` ran here)."""
        with self._lock:
            known = self._done.get(key)
            if known is not None:
                return known, True
            gate = self._gates.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                known = self._done.get(key)
                if known is not None:
                    return known, True
            leaves = compute()
            with self._lock:
                self._done[key] = leaves
                self._gates.pop(key, None)
            return leaves, False



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

    def tensors(self, keep: bool = False) -> StagedTensors:
        """Each staged shard as a view of staging, or as its pieces where it was staged in pieces, made when first
        read (StagedTensors), with a memo kept with the slot while the same index is staged in it.

        `keep`: the views are kept with the slot too, for the next version staged in it with the same index (made
        per tensor, tens of thousands per MoE version); they go with the slot. Not over IPC: a colocated pod's
        receiver hands this very memory to its engine and refuses to release it while another view of it is
        alive (agent/transports/ipc.py). The memo holds no view, so it is kept either way."""
        slot = self.slot
        assert slot is not None, "a streamed rank has no staged tensors"
        seg = slot.segment
        memo: dict[Any, Any] | None = None
        known = slot.__dict__.get("memo")
        if self.index is not None:
            if known is not None and known[0] is self.index and known[1] is seg.tensor:
                memo = known[2]
            else:
                memo = {}
                slot.__dict__["memo"] = (self.index, seg.tensor, memo)
        kept = slot.__dict__.get("views")
        if keep and self.index is not None and kept is not None and kept[0] is self.index and \
                kept[1] is seg.tensor:
            views = kept[2]
            return StagedTensors(lambda: _as_tensors(views), seg.tensor, memo)
        slot.__dict__["views"] = None

        def make() -> dict[str, torch.Tensor | ShardPieces]:
            views = staged_views(seg, self.metas)
            if keep and self.index is not None:
                slot.__dict__["views"] = (self.index, seg.tensor, views)
            return _as_tensors(views)

        return StagedTensors(make, seg.tensor, memo)


def _as_tensors(views: dict[str, StagedView]) -> dict[str, torch.Tensor | ShardPieces]:
    return {name: v if isinstance(v, torch.Tensor) else ShardPieces(v[0], v[1], v[2]) for name, v in views.items()}


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


class StagedVersions:
    """Versions the local trainer ranks published, keyed by version; thread-safe."""

    def __init__(self, ranks: list[int], prefix: str, *, keep: int = 1,
                 on_complete: Callable[[StagedVersion], None] | None = None,
                 ring: BucketRing | None = None) -> None:
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
            newly = self._mark_complete(sv)
        return self._after_stage(sv, old, newly)

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
            newly = self._mark_complete(sv)
        return self._after_stage(sv, old, newly)

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
        log.info("staging.withdraw version=%s", version)
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

    def _mark_complete(self, sv: StagedVersion) -> bool:
        """Under the lock: whether this rank's stage completed the version (every rank staged), evicting what
        the new version makes old, and waking the waiters either way."""
        newly = not sv.complete and all(r in sv.ranks for r in self.ranks)
        if newly:
            sv.complete = True
            self._evict()
        self._lock.notify_all()
        return newly

    def _after_stage(self, sv: StagedVersion, old: RankStage | None, newly: bool) -> StagedVersion:
        """Outside the lock: free the slot the rank's previous stage held, report dropped versions, and announce
        a version that has just completed."""
        if old is not None and old.slot is not None:
            self._release_slot(old.slot)
        self._notify_dropped()
        if newly and self.on_complete:
            self.on_complete(sv)
        return sv

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
            log.info("staging.evict version=%s", v)
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
