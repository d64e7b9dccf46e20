"""A destination rank's side of the sync protocol (agent/transfer/sync.py): WeightReceiver receives what it needs
of a version and hands complete (name, tensor) pairs on, bucket by bucket.

Double buffering: bucket k+1 is in flight while bucket k is unpacked and handed to `on_bucket`; the receive slots
are reused across versions. Zero copy: given destination tensors (`into=`) in the arena layout, whole buckets are
written straight into them (NCCL/gloo) or with one copy per bucket (IPC), without per-tensor unpacking; a tensor
that arrives in pieces can be handed on piece by piece where it landed (`hand_pieces`, PlacedTensors).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from weightsync.agent.gcpause import collector_paused
from weightsync.agent.plan import BucketPlan, TensorShard, TransferPlan
from weightsync.agent.plan.buckets import dtype_name, entry_view, entry_views, to_dtype
from weightsync.agent.transfer.sync import (
    BucketTap,
    MemoryKey,
    PeerFailed,
    Place,
    PlacedTensors,
    PlanMismatch,
    SyncEndpoint,
    SyncError,
    SyncHooks,
    SyncStats,
    bytes_in_storage_of,
    in_place,
    memory_key,
)
from weightsync.agent.transports.base import Pending, Transport, TransportError, WorldMap, dst
from weightsync.agent.wire.link import Link, LinkError, Mailbox

log = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
#: Receives straight into destination memory need no buffer; this bounds how far ahead they are posted.
MAX_DIRECT_INFLIGHT = 16
#: Receives complete (name, tensor) pairs of one bucket. The tensors are views into reusable buffers:
#: copy (load) them before returning; they are invalid afterwards.
OnBucket = Callable[[NamedTensors], None]


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


class WeightReceiver(SyncEndpoint):
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
        super().__init__(plan, dst(rank), transport, peers, device, timeout, hooks, world)
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
        #: (memory_key of `into`, per bucket the byte offset of its in-place target in the storage of its first
        #: entry's tensor, or None): reused while a caller passes the same destination memory
        self._into_places: tuple[MemoryKey, list[int | None]] | None = None

    def _assembly_buffer(self, name: str) -> torch.Tensor:
        buf = self._assembly.get(name)
        if buf is None:
            s = self.needs[name]
            buf = torch.empty(s.box.shape, dtype=to_dtype(s.dtype), device=self.device)
            self._assembly[name] = buf
        return buf

    def _places_in(self, into: Mapping[str, torch.Tensor]) -> list[int | None]:
        """Per bucket (plan order), where it lands in place in `into`: the byte offset of its target in the
        storage of its first entry's tensor, or None (it takes a slot). Worked out per piece once and reused while
        `into` holds the same memory (memory_key): an MoE bucket has hundreds of pieces, each a box to slice."""
        key = memory_key(into.values())
        if self._into_places is not None and self._into_places[0] == key:
            return self._into_places[1]
        spans = memory_spans(into.values())
        places: list[int | None] = []
        for bucket in self.buckets:
            regions = [into[e.piece.name][e.piece.box.slices_within(self.needs[e.piece.name].box)]
                       for e in bucket.entries]
            target = in_place(bucket, regions)
            del regions
            if target is not None and not gaps_are_free(bucket, target, spans):
                target = None  # the padding would overwrite other destination memory
            places.append(None if target is None else int(target.storage_offset()))
        self._into_places = (key, places)
        return places

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
        places = self._places_in(into) if into is not None else []

        def post() -> None:
            nonlocal next_post
            while next_post < len(buckets) and len(inflight) < MAX_DIRECT_INFLIGHT:
                bucket = buckets[next_post]
                if into is not None:
                    at = places[next_post]
                    target = None if at is None else \
                        bytes_in_storage_of(into[bucket.entries[0].piece.name], at, bucket.nbytes)
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
            with collector_paused():  # a view and a leaf per piece, alive until the bucket is loaded (agent/gcpause.py)
                stats.copied_bytes += self._consume(version, bucket, data, meta, remaining, on_bucket, into,
                                                    slot < 0, target)
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
