"""The sync protocol that moves one weight version between agents, and what both of its ends share.

A source rank's WeightSender (agent/transfer/send.py) and a destination rank's WeightReceiver
(agent/transfer/receive.py) move a version over any Transport, with a control Mailbox to each peer; both
are a SyncEndpoint, fail with a SyncError, call SyncHooks and report SyncStats, all defined here.

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

Double buffering and zero copy (a bucket sent from, or received into, memory that already sits like it,
see `in_place`) are each side's: see send.py and receive.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightsync.agent.plan import BucketPlan, TransferPlan
from weightsync.agent.plan.buckets import BucketLayout
from weightsync.agent.transports.base import Endpoint, Transport, TransportContext, WorldMap
from weightsync.agent.wire.link import Link, Mailbox

log = logging.getLogger(__name__)

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
    return storage_bytes(storage, base - sp, bucket.nbytes, first.device)


#: What decides where a tensor's bytes are, per tensor (MemoryKey): its storage (address, size), its own address,
#: strides and device. Shapes and dtypes are checked against the plan separately.
MemoryKey = tuple[tuple[int, int, int, tuple[int, ...], torch.device], ...]


def memory_key(tensors: Iterable[torch.Tensor]) -> MemoryKey:
    """Equal keys mean the same memory at the same addresses, laid out the same: `in_place` and the gaps
    between a bucket's entries come out the same, so what they found for one version holds for the next.

    The storage is part of the key, not only the tensor's address: tensors freed and made again at the same
    addresses, but as separate allocations, must not pass for one storage a bucket spans."""
    key = []
    for t in tensors:
        st = t.untyped_storage()
        key.append((st.data_ptr(), st.nbytes(), t.data_ptr(), t.stride(), t.device))
    return tuple(key)


def storage_bytes(storage: torch.UntypedStorage, offset: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` of `storage` from byte `offset` as a 1-d uint8 tensor: a bucket's bytes where they sit."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, offset, (nbytes,), (1,))


def bytes_in_storage_of(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """`nbytes` from byte `offset` of the storage under `t`: a bucket's bytes where an earlier version found them
    (`in_place`), made again from the offset kept instead of from a region per piece."""
    return storage_bytes(t.untyped_storage(), offset, nbytes, t.device)


class SyncEndpoint:
    """What a sender and a receiver have in common: the plan, this endpoint, its transport and a control Mailbox
    per peer rank (a Link is wrapped once), the transport context of a version and aborting every peer."""

    def __init__(
        self,
        plan: TransferPlan,
        me: Endpoint,
        transport: Transport,
        peers: Mapping[int, Mailbox | Link],
        device: torch.device | str,
        timeout: float,
        hooks: SyncHooks | None,
        world: WorldMap | None,
    ) -> None:
        self.plan = plan
        self.me = me
        self.transport = transport
        self.peers = {r: (p if isinstance(p, Mailbox) else Mailbox(p)) for r, p in peers.items()}
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

