"""A source rank's side of the sync protocol (agent/transfer/sync.py): WeightSender sends its pieces of a version.

Double buffering: bucket k+1 is packed into a slot buffer while bucket k moves; the buffers are reused across
versions. Zero copy: a bucket whose source tensors already sit exactly like it (TransferPlan.arena layout, e.g.
the trainer agent's staging) is sent from there without a pack. Ring staging (agent/staging/ring.py) and relays
(agent/transfer/relay.py) stream the buckets instead (BucketStream), each sent from the slot it was filled into.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from weightsync.agent.gcpause import collector_paused
from weightsync.agent.plan import BucketPlan, TensorShard, TransferPlan
from weightsync.agent.plan.buckets import dtype_name, entry_view, to_dtype
from weightsync.agent.staging.index import ShardPieces
from weightsync.agent.transfer.sync import (
    BucketStream,
    MemoryKey,
    PeerFailed,
    PlanMismatch,
    SyncEndpoint,
    SyncError,
    SyncHooks,
    SyncStats,
    bytes_in_storage_of,
    in_place,
    memory_key,
)
from weightsync.agent.transports.base import Pending, Transport, TransportError, WorldMap, src
from weightsync.agent.wire.link import Link, LinkError, Mailbox, RemoteAbort

log = logging.getLogger(__name__)


def source_region(t: torch.Tensor | ShardPieces, box: Any, src_box: Any) -> torch.Tensor:
    """The part `box` (global coordinates) of a source shard `t` whose box is `src_box`."""
    if isinstance(t, ShardPieces):
        return t.region([o - so for o, so in zip(box.offset, src_box.offset, strict=True)], box.shape)
    if box == src_box:  # the whole shard (the common case): no view to make
        return t
    return t[box.slices_within(src_box)]


class WeightSender(SyncEndpoint):
    """Source rank `rank` of `plan`: sends its pieces of every version it is asked to send.

    `peers` maps each destination rank this source sends to (plan.dsts_of(rank)) to a Mailbox (or a
    Link, wrapped once). Reuse one sender for many versions; create a new one when the plan changes.
    """

    def __init__(
        self,
        plan: TransferPlan,
        rank: int,
        transport: Transport,
        peers: Mapping[int, Mailbox | Link],
        *,
        device: torch.device | str = "cpu",
        timeout: float = 600.0,
        hooks: SyncHooks | None = None,
        world: WorldMap | None = None,
    ) -> None:
        super().__init__(plan, src(rank), transport, peers, device, timeout, hooks, world)
        self.rank = rank
        self.buckets = plan.buckets_from(rank)
        self.dsts = plan.dsts_of(rank)
        missing = [d for d in self.dsts if d not in self.peers]
        if missing:
            raise SyncError(f"source rank {rank} has no control link to destination ranks {missing}")
        known = plan.memo.get(("sender", rank))
        if known is None:  # once per plan and rank: an MoE plan has tens of thousands of pieces
            shards = {s.name: s for s in plan.sources[rank]} if rank < plan.num_src else {}
            sent = sorted({e.piece.name for b in self.buckets for e in b.entries})
            known = plan.memo[("sender", rank)] = (shards, [(n, shards[n].box.shape, to_dtype(shards[n].dtype))
                                                            for n in sent])
        self.shards: dict[str, TensorShard] = known[0]
        self._expected: list[tuple[str, tuple[int, ...], torch.dtype]] = known[1]
        #: tensors passed as a plain mapping (no StagedTensors memo): (memory_key of the sent tensors, per bucket
        #: the byte offset of its bytes in the storage of its first entry's tensor, or None), while they stay put
        self._places: tuple[MemoryKey, dict[int, int | None]] | None = None

    def check_tensors(self, tensors: Mapping[str, torch.Tensor | ShardPieces]) -> None:
        """Raise SyncError unless `tensors` has every tensor this rank sends, with its local shape/dtype."""
        problems = []
        for name, shape, dtype in self._expected:
            s = self.shards[name]
            t = tensors.get(name)
            if t is None:
                problems.append(f"{name!r} is missing")
            elif t.shape != shape or t.dtype != dtype:
                problems.append(f"{name!r} is {dtype_name(t.dtype)}{list(t.shape)}, the plan says "
                                f"{s.dtype}{list(s.box.shape)}")
        if problems:
            more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
            raise SyncError(f"source rank {self.rank}: tensors do not match the plan: "
                            f"{'; '.join(problems[:5])}{more}")

    def send_version(self, version: int, tensors: Mapping[str, torch.Tensor | ShardPieces],
                     stream: BucketStream | None = None) -> SyncStats:
        """Send `version`: `tensors` maps each name to this rank's local shard (the plan's box). Returns
        once every destination acknowledged every byte; raises SyncError (after aborting the peers)
        otherwise. The tensors must not change until this returns. With `stream` (ring staging), the
        buckets come from it instead, one ring slot at a time, and `tensors` is not read."""
        stats = SyncStats(version, str(self.me), self.plan.hash)
        t0 = time.perf_counter()
        where = "validating tensors"
        try:
            memo: dict[Any, Any] | None = getattr(tensors, "memo", None)  # StagedTensors: kept with the slot
            if stream is None and (memo is None or ("checked", self.plan.hash, self.rank) not in memo):
                self.check_tensors(tensors)
                if memo is not None:  # the same index in the same slot: the same views, as checked
                    memo[("checked", self.plan.hash, self.rank)] = True
            where = "agreeing on the plan"
            self._handshake(version)
            stats.handshake_seconds = time.perf_counter() - t0
            where = "binding the transport"
            self.transport.bind(self._ctx("dst", version))
            where = "sending buckets"
            if stream is not None:
                self._stream_buckets(version, stream, stats)
            else:
                with collector_paused():  # a region per piece per bucket (agent/gcpause.py)
                    self._send_buckets(version, tensors, stats)
            if getattr(tensors, "materialized", True):  # views never made copied nothing
                stats.copied_bytes += sum(t.copied_bytes for t in tensors.values() if isinstance(t, ShardPieces))
            where = "finishing"
            done_meta = self.hooks.on_send_done(version)
            for d in self.dsts:
                self.peers[d].send("sync.done", version=version, buckets=sum(d in b.dsts for b in self.buckets),
                                   bytes=stats.bytes, meta=done_meta)
            for d in self.dsts:
                _h, _ = self.peers[d].get("sync.ack", timeout=self.timeout, match={"version": version})
        except PlanMismatch as exc:
            self._abort_all(self.dsts, str(exc))
            raise
        except Exception as exc:
            msg = f"source rank {self.rank} failed to send version {version} while {where}: {exc}"
            self._abort_all(self.dsts, msg)
            cls = PeerFailed if isinstance(exc, (LinkError, TransportError)) else SyncError
            raise cls(msg) from exc
        stats.seconds = time.perf_counter() - t0
        log.info("sync.sent version=%s endpoint=%s buckets=%s direct=%s bytes=%s copied_bytes=%s seconds=%.3f", version,
                 self.me, stats.buckets, stats.direct_buckets, stats.bytes, stats.copied_bytes, stats.seconds)
        return stats

    def _handshake(self, version: int) -> None:
        for d in self.dsts:
            mine = [b for b in self.buckets if d in b.dsts]
            self.peers[d].send("sync.begin", version=version, plan_hash=self.plan.hash, buckets=len(mine),
                               bytes=sum(b.nbytes for b in mine), bucket_meta=self.hooks.sends_bucket_meta)
        for d in self.dsts:
            try:
                h, _ = self.peers[d].get("sync.ready", timeout=self.timeout, match={"version": version})
            except RemoteAbort as exc:
                raise PlanMismatch(f"destination rank {d} refused version {version}: {exc}") from exc
            if h.get("plan_hash") != self.plan.hash:
                raise PlanMismatch(
                    f"destination rank {d} computed plan {h.get('plan_hash')}, source rank {self.rank} computed "
                    f"{self.plan.hash}: the agents disagree on topology, layouts or bucketSizeMB; nothing was sent"
                )
        for d in self.dsts:
            self.peers[d].send("sync.go", version=version)

    def _send_buckets(self, version: int, tensors: Mapping[str, torch.Tensor | ShardPieces], stats: SyncStats) -> None:
        """Issue every bucket in plan order. A bucket whose bytes already sit in place is sent from
        there (no slot, no wait); others are packed into slot buffers, reused round-robin once the
        bucket that last used them completed (double buffering with num_slots=2)."""
        n = self.transport.num_slots
        slots: list[Pending[None] | None] = [None] * n
        direct: list[Pending[None]] = []
        next_slot = 0
        # kept with the staging slot (StagedTensors): where a bucket sits there, worked out per piece once, not per
        # piece and version (an MoE bucket has hundreds of pieces); then no view of the slot is read at all
        memo: dict[Any, Any] | None = getattr(tensors, "memo", None)
        segment: torch.Tensor | None = getattr(tensors, "segment", None)
        places = self._places_of(tensors) if memo is None else None
        for bucket in self.buckets:
            for d in self.dsts:
                reason = self.peers[d].aborted
                if reason is not None:
                    raise RemoteAbort(f"destination rank {d} aborted: {reason}")
            tp = time.perf_counter()
            key = ("in_place", self.plan.hash, self.rank, bucket.index)
            at = memo.get(key) if memo is not None else None
            regions: list[torch.Tensor] | None = None
            data: torch.Tensor | None
            if at is not None and segment is not None:  # as in_place found it there for an earlier version
                data = bytes_in_storage_of(segment, at, bucket.nbytes)
            elif places is not None and bucket.index in places:  # the same memory as an earlier version
                off = places[bucket.index]
                first = tensors[bucket.entries[0].piece.name]
                assert isinstance(first, torch.Tensor)  # _places_of takes plain tensors only
                data = None if off is None else bytes_in_storage_of(first, off, bucket.nbytes)
            else:
                regions = [source_region(tensors[e.piece.name], e.piece.box, e.piece.src_box)
                           for e in bucket.entries]
                data = in_place(bucket, regions)  # the tensors already sit like the bucket: no pack
                if data is not None and memo is not None and segment is not None and \
                        data.untyped_storage().data_ptr() == segment.untyped_storage().data_ptr():
                    memo[key] = data.storage_offset()
                if places is not None:
                    places[bucket.index] = None if data is None else int(data.storage_offset())
            if data is not None and self.transport.supports_direct_send(data):
                del regions
                meta = self.hooks.on_send_bucket(version, bucket, data)
                self._send_meta(version, bucket, meta)
                pending = self.transport.start_send_from(bucket, data)
                if pending is not None:
                    direct.append(pending)
                    stats.direct_buckets += 1
                    stats.pack_seconds += time.perf_counter() - tp
                    self._count(stats, bucket)
                    continue
                raise SyncError(f"transport {self.transport.name} declined a direct send it said it supports")
            slot, next_slot = next_slot, (next_slot + 1) % n
            prev = slots[slot]
            if prev is not None:
                tw = time.perf_counter()
                prev.wait(self.timeout)
                stats.wait_seconds += time.perf_counter() - tw
                tp = time.perf_counter()
            buf = self.transport.send_buffer(slot)
            if regions is None:
                regions = [source_region(tensors[e.piece.name], e.piece.box, e.piece.src_box)
                           for e in bucket.entries]
            for e, region in zip(bucket.entries, regions, strict=True):
                entry_view(buf, e.bucket_entry).copy_(region)
                stats.copied_bytes += e.piece.nbytes
            del regions
            meta = self.hooks.on_send_bucket(version, bucket, buf[: bucket.nbytes])
            stats.pack_seconds += time.perf_counter() - tp
            self._send_meta(version, bucket, meta)
            slots[slot] = self.transport.start_send(bucket, slot)
            self._count(stats, bucket)
        tw = time.perf_counter()
        for pend in [*direct, *slots]:
            if pend is not None:
                pend.wait(self.timeout)
        stats.wait_seconds += time.perf_counter() - tw

    def _places_of(self, tensors: Mapping[str, torch.Tensor | ShardPieces]) -> dict[int, int | None] | None:
        """Where each bucket sits in place in a plain mapping of tensors, filled in as buckets are sent (bucket index
        -> byte offset in the storage of its first entry's tensor, or None): kept while the mapping holds the same
        memory (memory_key), so a later version makes no region per piece. None for ShardPieces (assembled per
        version)."""
        sent = [t for name, _shape, _dtype in self._expected if isinstance(t := tensors[name], torch.Tensor)]
        if len(sent) != len(self._expected):
            return None
        key = memory_key(sent)
        if self._places is None or self._places[0] != key:
            self._places = (key, {})
        return self._places[1]

    def _stream_buckets(self, version: int, stream: BucketStream, stats: SyncStats) -> None:
        """Ring staging: bucket k goes through ring slot k % depth. The slot is filled (by the trainer
        process) only once the send of the bucket it held last completed, and each bucket is sent from its
        slot without a pack, so bucket k + 1 is filled while bucket k is on the wire."""
        depth = max(1, int(stream.depth))
        inflight: list[Pending[None] | None] = [None] * depth
        for k, bucket in enumerate(self.buckets):
            for d in self.dsts:
                reason = self.peers[d].aborted
                if reason is not None:
                    raise RemoteAbort(f"destination rank {d} aborted: {reason}")
            slot = k % depth
            prev = inflight[slot]
            if prev is not None:
                tw = time.perf_counter()
                prev.wait(self.timeout)
                inflight[slot] = None
                stats.wait_seconds += time.perf_counter() - tw
            tp = time.perf_counter()
            data = stream.fill(k, bucket, slot)
            if not self.transport.supports_direct_send(data):
                raise SyncError(f"transport {self.transport.name} cannot send from ring staging "
                                f"({data.device}); use WEIGHTSYNC_STAGING=version")
            meta = self.hooks.on_send_bucket(version, bucket, data)
            stats.pack_seconds += time.perf_counter() - tp
            self._send_meta(version, bucket, meta)
            pending = self.transport.start_send_from(bucket, data)
            if pending is None:
                raise SyncError(f"transport {self.transport.name} declined a send from ring staging")
            handed = getattr(stream, "sent", None)
            if handed is not None:  # a relay (agent/transfer/relay.py): its receiver waits for the forward too
                pending = handed(bucket, pending)
            inflight[slot] = pending
            stats.direct_buckets += 1
            self._count(stats, bucket)
        tw = time.perf_counter()
        for pend in inflight:
            if pend is not None:
                pend.wait(self.timeout)
        stats.wait_seconds += time.perf_counter() - tw

    def _send_meta(self, version: int, bucket: BucketPlan, meta: dict[str, Any] | None) -> None:
        if self.hooks.sends_bucket_meta:
            for d in bucket.dsts:
                self.peers[d].send("sync.bucket", version=version, index=bucket.index, meta=meta)

    @staticmethod
    def _count(stats: SyncStats, bucket: BucketPlan) -> None:
        stats.buckets += 1
        stats.bytes += bucket.nbytes
        stats.tensors += len(bucket.entries)
