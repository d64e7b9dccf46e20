"""Move one weight version between agents: WeightSender (a source rank) and WeightReceiver (a
destination rank), over any Transport, with a control Mailbox to each peer.

Protocol per version, on every src<->dst link that carries at least one bucket:

    src -> dst  sync.begin {version, plan_hash, buckets, bytes, bucket_meta}
    dst -> src  sync.ready {version, plan_hash}        (or abort: hash / version mismatch)
    src -> dst  sync.go    {version}                   (only once EVERY destination is ready)
    ...buckets through the transport, in plan order, double-buffered...
    src -> dst  sync.bucket {version, index, meta}     (per bucket, only when a hook adds metadata)
    src -> dst  sync.done  {version, buckets, bytes, meta}
    dst -> src  sync.ack   {version}                   (after every bucket was handed on and verified)

So the plan hash is compared by every pair before any byte moves, and a receiver reports success
only when everything arrived. Any failure on either side sends `abort` with the reason to every peer
of this endpoint and raises a SyncError; a receiver that raised must not commit the version (the
caller commits only after `receive_version` returned). An abort poisons the control mailboxes it
crossed: after a failed version, reconnect the links (and, for NCCL, the groups are rebuilt).

Double buffering: the sender packs bucket k+1 while bucket k moves; the receiver has bucket k+1 in
flight while bucket k is unpacked and handed to `on_bucket`. Buffers are reused across versions.

Zero copy: a bucket whose source tensors already sit exactly like it (TransferPlan.arena layout,
e.g. the trainer agent's staging) is sent from there without a pack; a receiver given destination
tensors (`into=`) in the arena layout gets whole buckets written straight into them (NCCL/gloo) or
with one copy per bucket (IPC), without per-tensor unpacking.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightsync.agent.plan import BucketPlan, TensorShard, TransferPlan
from weightsync.agent.plan.buckets import BucketLayout, dtype_name, entry_view, entry_views, to_dtype
from weightsync.agent.transports.base import (
    Endpoint,
    Pending,
    Transport,
    TransportContext,
    TransportError,
    WorldMap,
    dst,
    src,
)
from weightsync.agent.wire.link import Link, LinkError, Mailbox, RemoteAbort

log = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
#: Receives straight into destination memory need no buffer; this bounds how far ahead they are posted.
MAX_DIRECT_INFLIGHT = 16
#: Receives complete (name, tensor) pairs of one bucket. The tensors are views into reusable buffers:
#: copy (load) them before returning; they are invalid afterwards.
OnBucket = Callable[[NamedTensors], None]
#: Where a piece goes in the tensor its engine loads: (offset of the piece in it, the tensor's shape).
Place = tuple[tuple[int, ...], tuple[int, ...]]


class PlacedTensors(list[tuple[str, torch.Tensor]]):
    """A bucket's (name, tensor) pairs where some pairs may be PIECES of the named tensor (a receiver with
    `hand_pieces`): `places[i]` says where pair i goes in it. The engine loads each piece into its place
    itself (its own load), instead of the agent assembling the tensor first and the engine copying that."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]] = (), places: Mapping[int, Place] | None = None,
                 flat: tuple[torch.Tensor, BucketLayout] | None = None) -> None:
        super().__init__(items)
        self.places: dict[int, Place] = dict(places or {})
        #: (the bucket's bytes, its layout) when pair i is entry i of the layout viewed in those bytes, every
        #: pair: an engine may then take the bucket whole (one request) instead of finding each tensor
        self.flat = flat


class BucketStream(Protocol):
    """Where a streamed version's buckets come from (agent/staging/ring.py `RingSource`, agent/transfer/relay.py `RelayStream`):
    `fill(k, bucket, slot)` writes bucket k (plan order) into ring slot `slot` (of `depth`) and returns its
    bytes, which stay valid until that slot is filled again. A stream may also have `sent(bucket, pending)`,
    which gets each bucket's send in flight and returns the Pending the sender waits for."""

    depth: int

    def fill(self, k: int, bucket: BucketPlan, slot: int) -> torch.Tensor: ...


class BucketTap(Protocol):
    """A receiver's buckets, lent to a relay (agent/transfer/relay.py `RelayTap`): `offer` once a bucket's checks
    passed, `settle` before its memory is reused (returns once the relay is done with it), `done` with each
    source's sync.done metadata, `fail` when this receive failed."""

    def offer(self, bucket: BucketPlan, data: torch.Tensor, meta: dict[str, Any] | None) -> None: ...

    def settle(self, bucket: BucketPlan) -> None: ...

    def done(self, src: int, meta: dict[str, Any] | None) -> None: ...

    def fail(self, reason: str) -> None: ...


class SyncError(RuntimeError):
    """A version could not be moved; nothing of it may be committed. The message says why."""


class PlanMismatch(SyncError):
    """Two agents computed different plans (or are at different versions); no byte was moved."""


class PeerFailed(SyncError):
    """A peer died, aborted, sent a bad frame or timed out in the middle of a version."""


class SyncHooks:
    """Extension points (checksums, delta bookkeeping). The defaults do nothing.

    Metadata returned by the sender hooks travels over the control link and is handed to the
    receiver hooks; raising in a receiver hook fails the version (nothing committed)."""

    def on_send_bucket(self, version: int, bucket: BucketPlan, data: torch.Tensor) -> dict[str, Any] | None:
        """Sender, after bucket `bucket` was packed into `data` (uint8, bucket.nbytes bytes)."""
        return None

    def on_recv_bucket(
        self, version: int, bucket: BucketPlan, data: torch.Tensor, meta: dict[str, Any] | None
    ) -> None:
        """Receiver, after the bucket's bytes arrived, before its tensors are handed on."""

    def on_send_done(self, version: int) -> dict[str, Any] | None:
        """Sender, after its last bucket."""
        return None

    def on_recv_done(self, version: int, metas: Mapping[int, dict[str, Any] | None]) -> None:
        """Receiver, after every bucket; `metas` maps each source rank to its on_send_done result."""

    @property
    def sends_bucket_meta(self) -> bool:
        """True when on_send_bucket may return metadata (the receiver then waits for it)."""
        return type(self).on_send_bucket is not SyncHooks.on_send_bucket


@dataclass
class SyncStats:
    """What one version cost one endpoint (for logs, /metrics and the bench)."""

    version: int
    endpoint: str
    plan_hash: str
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    handshake_seconds: float = 0.0
    pack_seconds: float = 0.0
    wait_seconds: float = 0.0
    load_seconds: float = 0.0
    tensors: int = 0
    direct_buckets: int = 0  # buckets moved without a pack (sender) or unpack copy (receiver)
    copied_bytes: int = 0  # bytes this endpoint copied besides the wire (sender: packs; receiver: unpacks)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


class ShardPieces:
    """A source shard staged as separate pieces, each where its bucket wants it (TransferPlan.source_arena),
    instead of as one tensor: the sender reads a piece where it lies. `pieces` maps a box in the shard's
    own coordinates (offset, shape) to its view."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int],
                 pieces: Mapping[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor]) -> None:
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.pieces = dict(pieces)
        self._whole: torch.Tensor | None = None
        self.copied_bytes = 0  # bytes assembled for a region that is not one staged piece

    def region(self, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """The box (shard coordinates) as a tensor: the staged piece itself when the box is one, else a
        slice of the pieces assembled once (a plan other than the one the staging was laid out for)."""
        key = (tuple(int(o) for o in offset), tuple(int(n) for n in shape))
        view = self.pieces.get(key)
        if view is not None:
            return view
        whole = self._whole
        if whole is None:
            first = next(iter(self.pieces.values()))
            whole = self._whole = torch.empty(self.shape, dtype=self.dtype, device=first.device)
            for (o, n), v in self.pieces.items():
                whole[tuple(slice(a, a + b) for a, b in zip(o, n, strict=True))].copy_(v)
                self.copied_bytes += v.numel() * v.element_size()
        return whole[tuple(slice(a, a + b) for a, b in zip(key[0], key[1], strict=True))]


def source_region(t: torch.Tensor | ShardPieces, box: Any, src_box: Any) -> torch.Tensor:
    """The part `box` (global coordinates) of a source shard `t` whose box is `src_box`."""
    if isinstance(t, ShardPieces):
        return t.region([o - so for o, so in zip(box.offset, src_box.offset, strict=True)], box.shape)
    if box == src_box:  # the whole shard (the common case): no view to make
        return t
    return t[box.slices_within(src_box)]


def in_place(bucket: BucketPlan, regions: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A uint8 view of the memory the bucket's regions occupy, if they already sit exactly like the
    bucket (contiguous, one storage, at the bucket's relative offsets), else None. Then the bytes can
    be sent from, or received into, that memory directly."""
    if not regions:
        return None
    first = regions[0]
    storage = first.untyped_storage()
    sp = storage.data_ptr()
    base = first.data_ptr() - bucket.entries[0].offset
    if base < sp or base - sp + bucket.nbytes > storage.nbytes():
        return None
    dev = first.device
    # each region starts at its entry's offset from `base`, inside the bucket's range of the first region's
    # storage (checked above), and is contiguous: then the bucket's bytes there are exactly the regions'
    for e, r in zip(bucket.entries, regions, strict=True):
        if r.data_ptr() != base + e.offset or r.device != dev or not r.is_contiguous():
            return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, base - sp, (bucket.nbytes,), (1,))


def memory_spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Sorted, merged [start, end) address ranges the tensors occupy (device-agnostic pointers)."""
    raw = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    merged: list[tuple[int, int]] = []
    for lo, hi in raw:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def gaps_are_free(bucket: BucketPlan, target: torch.Tensor, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether writing the whole bucket into `target` leaves other memory alone: every padding gap
    between its entries must lie outside every destination tensor (`spans`)."""
    base = target.data_ptr()
    cursor = 0
    for e in bucket.entries:
        if e.offset > cursor and _overlaps(spans, base + cursor, base + e.offset):
            return False
        cursor = e.offset + e.piece.nbytes
    return True


def _overlaps(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> bool:
    i = bisect.bisect_right(spans, (lo, float("inf"))) - 1
    for start, end in spans[max(i, 0) :]:
        if start >= hi:
            return False
        if end > lo:
            return True
    return False


def _mailboxes(peers: Mapping[int, Mailbox | Link]) -> dict[int, Mailbox]:
    return {r: (p if isinstance(p, Mailbox) else Mailbox(p)) for r, p in peers.items()}


class _Endpoint:
    def __init__(
        self,
        plan: TransferPlan,
        me: Endpoint,
        transport: Transport,
        peers: Mapping[int, Mailbox],
        device: torch.device | str,
        timeout: float,
        hooks: SyncHooks | None,
        world: WorldMap | None,
    ) -> None:
        self.plan = plan
        self.me = me
        self.transport = transport
        self.peers = dict(peers)
        self.device = torch.device(device)
        self.timeout = timeout
        self.hooks = hooks or SyncHooks()
        self.world = world

    def _ctx(self, peer_role: str, version: int) -> TransportContext:
        peers = {Endpoint(peer_role, r): mb for r, mb in self.peers.items()}  # type: ignore[arg-type]
        return TransportContext(self.plan, self.me, peers, self.device, self.timeout, self.world, version)

    def _abort_all(self, ranks: Sequence[int], reason: str) -> None:
        for r in ranks:
            mb = self.peers.get(r)
            if mb is not None:
                mb.abort(reason)
        try:
            self.transport.abort(reason)
        except Exception:  # the original failure is the one to report
            log.exception("sync.transport_abort_failed endpoint=%s", self.me)


class WeightSender(_Endpoint):
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
        super().__init__(plan, src(rank), transport, _mailboxes(peers), device, timeout, hooks, world)
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
            if stream is None:
                self.check_tensors(tensors)
            where = "agreeing on the plan"
            self._handshake(version)
            stats.handshake_seconds = time.perf_counter() - t0
            where = "binding the transport"
            self.transport.bind(self._ctx("dst", version))
            where = "sending buckets"
            if stream is not None:
                self._stream_buckets(version, stream, stats)
            else:
                self._send_buckets(version, tensors, stats)
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
        for bucket in self.buckets:
            for d in self.dsts:
                reason = self.peers[d].aborted
                if reason is not None:
                    raise RemoteAbort(f"destination rank {d} aborted: {reason}")
            tp = time.perf_counter()
            regions = [source_region(tensors[e.piece.name], e.piece.box, e.piece.src_box) for e in bucket.entries]
            data = in_place(bucket, regions)  # the tensors already sit like the bucket: no pack
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


class WeightReceiver(_Endpoint):
    """Destination rank `rank` of `plan`: receives the tensors it needs (plan.needs[rank]) of a version
    and hands complete (name, tensor) pairs to a callback bucket by bucket.

    `peers` maps each source rank it receives from (plan.srcs_of(rank)) to a Mailbox (or a Link).
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
        hand_pieces: bool = False,
        tap: BucketTap | None = None,
    ) -> None:
        super().__init__(plan, dst(rank), transport, _mailboxes(peers), device, timeout, hooks, world)
        self.rank = rank
        #: a relay that forwards this rank's buckets to another replica (fanOut Relay): each bucket is
        #: offered once checked and its memory reused only once the relay settled it
        self.tap = tap
        #: hand the pieces of a tensor that arrives in pieces on where they landed (PlacedTensors), for an
        #: engine that loads them into place itself, instead of assembling it here (a copy, `unpack`)
        self.hand_pieces = hand_pieces
        self.buckets = plan.buckets_to(rank)
        self.srcs = plan.srcs_of(rank)
        missing = [s for s in self.srcs if s not in self.peers]
        if missing:
            raise SyncError(f"destination rank {rank} has no control link to source ranks {missing}")
        known = plan.memo.get(("receiver", rank))
        if known is None:  # once per plan and rank: an MoE plan has tens of thousands of pieces
            needs = {s.name: s for s in plan.needs[rank]}
            counts: dict[str, int] = {}
            for b in self.buckets:
                for e in b.entries:
                    counts[e.piece.name] = counts.get(e.piece.name, 0) + 1
            known = plan.memo[("receiver", rank)] = (needs, counts)
        self.needs: dict[str, TensorShard] = known[0]
        # Tensors that arrive in several pieces are assembled in buffers reused across versions.
        self._pieces: dict[str, int] = known[1]
        self._assembly: dict[str, torch.Tensor] = {}

    def _assembly_buffer(self, name: str) -> torch.Tensor:
        buf = self._assembly.get(name)
        if buf is None:
            s = self.needs[name]
            buf = torch.empty(s.box.shape, dtype=to_dtype(s.dtype), device=self.device)
            self._assembly[name] = buf
        return buf

    def check_into(self, into: Mapping[str, torch.Tensor]) -> None:
        """Raise SyncError unless `into` has a tensor of the needed shape and dtype for every need."""
        problems = []
        for name, s in sorted(self.needs.items()):
            t = into.get(name)
            if t is None:
                problems.append(f"{name!r} is missing")
            elif tuple(t.shape) != s.box.shape or dtype_name(t.dtype) != s.dtype:
                problems.append(f"{name!r} is {dtype_name(t.dtype)}{list(t.shape)}, need {s.dtype}{list(s.box.shape)}")
        if problems:
            raise SyncError(f"destination rank {self.rank}: `into` does not match the plan: {'; '.join(problems[:5])}")

    def receive_version(
        self,
        on_bucket: OnBucket | None = None,
        *,
        expected_version: int | None = None,
        into: Mapping[str, torch.Tensor] | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> SyncStats:
        """Receive the next version the sources begin. Returns only when every needed tensor arrived,
        was handed to `on_bucket` and every source confirmed it was done; the caller commits then.
        Raises PlanMismatch (nothing moved) or PeerFailed/SyncError (do not commit).

        `into` (optional): destination tensors by name (shape = this rank's box). The bytes are then
        written into them (straight off the wire when they sit like the bucket, see TransferPlan.arena)
        and `on_bucket` gets (name, into[name]) once a tensor is complete. Without `into`, `on_bucket`
        gets views of reusable buffers that must be copied before it returns. `on_progress(nbytes)` is called
        after each bucket was handed on (progress reports)."""
        stats = SyncStats(-1, str(self.me), self.plan.hash)
        t0 = time.perf_counter()
        where = "checking the destination tensors"
        version = -1
        try:
            if into is not None:
                self.check_into(into)
            where = "agreeing on the plan"
            version, bucket_meta = self._handshake(expected_version)
            stats.version = version
            stats.handshake_seconds = time.perf_counter() - t0
            where = "binding the transport"
            self.transport.bind(self._ctx("src", version))
            where = "receiving buckets"
            self._recv_buckets(version, on_bucket, bucket_meta, stats, into, on_progress)
            where = "finishing"
            metas: dict[int, dict[str, Any] | None] = {}
            for s in self.srcs:
                h, _ = self.peers[s].get("sync.done", timeout=self.timeout, match={"version": version})
                expect = sum(1 for b in self.buckets if b.src == s)
                if h.get("buckets") != expect:
                    raise SyncError(f"source rank {s} says it sent {h.get('buckets')} buckets, expected {expect}")
                metas[s] = h.get("meta")
                if self.tap is not None:
                    self.tap.done(s, h.get("meta"))
            self.hooks.on_recv_done(version, metas)
            for s in self.srcs:
                self.peers[s].send("sync.ack", version=version)
        except PlanMismatch as exc:
            if self.tap is not None:
                self.tap.fail(str(exc))
            self._abort_all(self.srcs, str(exc))
            raise
        except Exception as exc:
            which = f"version {version}" if version >= 0 else "a version"
            msg = f"destination rank {self.rank} failed to receive {which} while {where}: {exc}"
            if self.tap is not None:
                self.tap.fail(msg)
            self._abort_all(self.srcs, msg)
            cls = PeerFailed if isinstance(exc, (LinkError, TransportError)) else SyncError
            raise cls(msg) from exc
        stats.seconds = time.perf_counter() - t0
        log.info("sync.received version=%s endpoint=%s buckets=%s direct=%s bytes=%s copied_bytes=%s seconds=%.3f",
                 version, self.me, stats.buckets, stats.direct_buckets, stats.bytes, stats.copied_bytes, stats.seconds)
        return stats

    def _handshake(self, expected_version: int | None) -> tuple[int, bool]:
        begins: dict[int, dict[str, Any]] = {}
        for s in self.srcs:
            h, _ = self.peers[s].get("sync.begin", timeout=self.timeout)
            if expected_version is not None and h.get("version") != expected_version:
                raise PlanMismatch(f"source rank {s} began version {h.get('version')}, this destination expects "
                                   f"version {expected_version}")
            begins[s] = h
        if not begins:  # this rank needs nothing from anyone: an empty version
            return (expected_version if expected_version is not None else -1), False
        versions = {h.get("version") for h in begins.values()}
        if len(versions) != 1:
            raise PlanMismatch(f"source ranks began different versions {sorted(map(str, versions))}")
        version = int(next(iter(versions)))  # type: ignore[arg-type]
        for s, h in begins.items():
            if h.get("plan_hash") != self.plan.hash:
                raise PlanMismatch(
                    f"source rank {s} computed plan {h.get('plan_hash')}, destination rank {self.rank} computed "
                    f"{self.plan.hash}: the agents disagree on topology, layouts or bucketSizeMB; nothing was sent"
                )
            expect = sum(1 for b in self.buckets if b.src == s)
            if h.get("buckets") != expect:
                raise PlanMismatch(f"source rank {s} announces {h.get('buckets')} buckets, the plan says {expect}")
        for s in self.srcs:
            self.peers[s].send("sync.ready", version=version, plan_hash=self.plan.hash)
        for s in self.srcs:
            self.peers[s].get("sync.go", timeout=self.timeout, match={"version": version})
        return version, any(bool(h.get("bucket_meta")) for h in begins.values())

    def _recv_buckets(
        self,
        version: int,
        on_bucket: OnBucket | None,
        bucket_meta: bool,
        stats: SyncStats,
        into: Mapping[str, torch.Tensor] | None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        """Post receives in plan order, ahead of consumption: buckets received straight into `into`
        need no slot (up to MAX_DIRECT_INFLIGHT ahead); others take one of num_slots slot buffers, so
        bucket k+1 moves while bucket k is unpacked and handed on."""
        buckets = self.buckets
        remaining = dict(self._pieces)
        free = list(range(self.transport.num_slots))
        inflight: dict[int, tuple[Pending[torch.Tensor], int, torch.Tensor | None]] = {}
        next_post = 0
        spans = memory_spans(into.values()) if into is not None else []

        def post() -> None:
            nonlocal next_post
            while next_post < len(buckets) and len(inflight) < MAX_DIRECT_INFLIGHT:
                bucket = buckets[next_post]
                if into is not None:
                    regions = [into[e.piece.name][e.piece.box.slices_within(self.needs[e.piece.name].box)]
                               for e in bucket.entries]
                    target = in_place(bucket, regions)
                    del regions
                    if target is not None and not gaps_are_free(bucket, target, spans):
                        target = None  # the padding would overwrite other destination memory
                    if target is not None:
                        pending = self.transport.start_recv_into(bucket, -1, target)
                        if pending is not None:
                            inflight[next_post] = (pending, -1, None)
                            next_post += 1
                            continue
                else:
                    target = None
                if not free:
                    return
                slot = free.pop(0)
                # `target`: the destination is laid out like the bucket, so one copy moves it all
                inflight[next_post] = (self.transport.start_recv(bucket, slot), slot, target)
                next_post += 1

        for k, bucket in enumerate(buckets):
            post()
            tw = time.perf_counter()
            pending, slot, target = inflight.pop(k)
            data = pending.wait(self.timeout)
            del pending
            meta = None
            if bucket_meta:
                h, _ = self.peers[bucket.src].get("sync.bucket", timeout=self.timeout,
                                                  match={"version": version, "index": bucket.index})
                meta = h.get("meta")
            stats.wait_seconds += time.perf_counter() - tw
            tl = time.perf_counter()
            stats.copied_bytes += self._consume(version, bucket, data, meta, remaining, on_bucket, into, slot < 0,
                                                target)
            del data, target  # every view of the bucket must be gone before the transport releases it
            stats.load_seconds += time.perf_counter() - tl
            if self.tap is not None:
                self.tap.settle(bucket)  # forwarded (or the relay detached): the memory may be reused
            self.transport.release_recv(bucket, slot)
            if slot >= 0:
                free.append(slot)
            stats.buckets += 1
            stats.direct_buckets += int(slot < 0)
            stats.bytes += bucket.nbytes
            stats.tensors += len(bucket.entries)
            if on_progress is not None:
                on_progress(bucket.nbytes)
        incomplete = [name for name, left in remaining.items() if left]
        if incomplete:
            raise SyncError(f"tensors {incomplete[:5]} did not arrive completely")

    def _hand_whole(self, bucket: BucketPlan, remaining: dict[str, int]) -> dict[int, Place] | None:
        """The places of the pieces (PlacedTensors.places) when every piece of `bucket` is a whole needed tensor
        or a piece the engine places itself (`hand_pieces`): then the bucket is handed on as it landed, each
        entry a view, with no per-piece decision; None when some piece is assembled here. The box comparisons are
        made once per plan and rank (BucketPlan.memo); `remaining` is counted down here."""
        key = ("whole", self.rank, self.hand_pieces)
        if key not in bucket.memo:
            places: dict[int, Place] = {}
            whole = True
            for k, e in enumerate(bucket.entries):
                p, need = e.piece, self.needs[e.piece.name]
                if p.box == need.box:
                    continue
                if not self.hand_pieces:
                    whole = False
                    break
                places[k] = (tuple(o - n for o, n in zip(p.box.offset, need.box.offset, strict=True)),
                             need.box.shape)
            bucket.memo[key] = places if whole else None
        known: dict[int, Place] | None = bucket.memo[key]
        if known is None:
            return None
        for e in bucket.entries:
            remaining[e.piece.name] -= 1
        return known

    def _consume(
        self,
        version: int,
        bucket: BucketPlan,
        data: torch.Tensor,
        meta: dict[str, Any] | None,
        remaining: dict[str, int],
        on_bucket: OnBucket | None,
        into: Mapping[str, torch.Tensor] | None,
        direct: bool,
        target: torch.Tensor | None = None,
    ) -> int:
        """Verify, unpack (views), assemble split tensors and hand complete ones to `on_bucket`. Returns the
        bytes copied on the way (0 when the bucket is handed on where it landed)."""
        self.hooks.on_recv_bucket(version, bucket, data, meta)
        if self.tap is not None:
            self.tap.offer(bucket, data, meta)  # checked: a relay may forward it while the engine loads it
        copied = 0
        if target is not None and not direct:
            target.copy_(data)  # one memcpy for the whole bucket instead of one per tensor
            copied += bucket.nbytes
            direct = True
        ready = PlacedTensors()
        views = entry_views(data, bucket.layout.entries) if into is None else None
        places = self._hand_whole(bucket, remaining) if views is not None else None
        if places is not None:
            ready.extend(zip((e.name for e in bucket.layout.entries), views or (), strict=True))
            ready.places.update(places)
            ready.flat = (data, bucket.layout)
            if on_bucket is not None:
                on_bucket(ready)
            return 0
        for k, e in enumerate(bucket.entries):
            p = e.piece
            need = self.needs[p.name]
            remaining[p.name] -= 1
            if into is not None:
                if not direct:
                    into[p.name][p.box.slices_within(need.box)].copy_(entry_view(data, e.bucket_entry))
                    copied += p.nbytes
                if remaining[p.name] == 0:
                    ready.append((p.name, into[p.name]))
                continue
            assert views is not None
            view = views[k]
            if p.box == need.box:
                ready.append((p.name, view))  # the whole tensor in one piece: hand the view itself
                continue
            if self.hand_pieces:  # the piece where it landed, and where it goes: the engine loads it there
                ready.places[len(ready)] = (tuple(o - n for o, n in zip(p.box.offset, need.box.offset, strict=True)),
                                            need.box.shape)
                ready.append((p.name, view))
                continue
            asm = self._assembly_buffer(p.name)
            asm[p.box.slices_within(need.box)].copy_(view)
            copied += p.nbytes
            if remaining[p.name] == 0:
                ready.append((p.name, asm))
        if ready and on_bucket is not None:
            on_bucket(ready)
        return copied
