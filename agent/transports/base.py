"""The Transport interface: how one flattened bucket's bytes get from its source to its destinations.

Why one interface: the sync layer (agent/transfer/sync.py) owns the protocol (plan-hash agreement, ordering,
double buffering, assembly, commit); a transport only moves a packed bucket. IPC, NCCL/gloo and GDR
(NIXL) plug in here, and wrappers (delta encoding, fault injection) can wrap another transport.

Life cycle, per endpoint (one source rank or one destination rank of a plan):

    t = SomeTransport(...)                 # once per membership generation: groups, registrations
    t.bind(ctx)                            # per version; cheap when ctx.plan did not change
    # sender, for each of its buckets k (slot = k % t.num_slots):
    buf = t.send_buffer(slot)              # reusable uint8 buffer of >= plan max bucket bytes
    ...pack bucket k into buf[:bucket.nbytes]...
    p = t.start_send(bucket, slot); ...; p.wait(timeout)   # wait before the slot is packed again
    # receiver, for each of its buckets k:
    p = t.start_recv(bucket, slot)         # may be posted before bucket k-1 is consumed
    data = p.wait(timeout)                 # uint8 tensor of exactly bucket.nbytes bytes
    ...unpack views of data, hand them on...
    t.release_recv(bucket, slot)           # data is invalid afterwards (IPC: handle closed)
    t.close()

Zero copy (optional): when the sender's tensors already sit exactly like a bucket (see
TransferPlan.arena), the sync layer calls `start_send_from(bucket, data)` instead of packing, and a
receiver with destination tensors laid out like the bucket calls `start_recv_into(bucket, -1, out)`.
A transport returns None where it cannot (IPC on CPU sends only from registered shared segments).

Rules every transport keeps:
* Buckets are processed by every endpoint in plan order (`plan.buckets_from(src)` /
  `plan.buckets_to(dst)`); transports may rely on it to match sends with receives.
* At most `num_slots` buckets are in flight per endpoint; slot k % num_slots is reused only after
  the previous bucket on it completed (sender: its Pending returned; receiver: `release_recv`).
* Errors raise TransportError (or a subclass) with a message naming the bucket, peer and cause; after
  an error the endpoint is broken for this version and `abort` is called by the sync layer.
* Device-agnostic: buffers live on `ctx.device` (CPU tensors for gloo / POSIX shared memory, CUDA
  tensors for NCCL / CUDA IPC).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Literal, TypeVar

import torch

from weightsync.agent.plan import BucketPlan, TransferPlan
from weightsync.agent.wire.link import Mailbox

T_co = TypeVar("T_co", covariant=True)
Role = Literal["src", "dst"]


class TransportError(RuntimeError):
    """Moving a bucket failed: peer died, timeout, handle could not be opened, backend error."""


@dataclass(frozen=True, order=True)
class Endpoint:
    """One side of a plan: source rank `rank` (role "src") or destination rank `rank` (role "dst")."""

    role: Role
    rank: int

    def __str__(self) -> str:
        return f"{self.role}{self.rank}"


def src(rank: int) -> Endpoint:
    return Endpoint("src", rank)


def dst(rank: int) -> Endpoint:
    return Endpoint("dst", rank)


@dataclass(frozen=True)
class WorldMap:
    """Where each plan endpoint lives in a transport's world (torch.distributed rank, NIXL agent...).

    The default puts source ranks first: src r -> r, dst r -> num_src + r. An agent can pass an
    explicit mapping when its process group is laid out differently.
    """

    num_src: int
    num_dst: int
    explicit: Mapping[Endpoint, int] | None = None

    def rank_of(self, ep: Endpoint) -> int:
        if self.explicit is not None:
            return self.explicit[ep]
        return ep.rank if ep.role == "src" else self.num_src + ep.rank

    @property
    def world_size(self) -> int:
        if self.explicit is not None:
            return len(set(self.explicit.values()))
        return self.num_src + self.num_dst


@dataclass
class TransportContext:
    """What a transport needs to know for one version: the plan, which endpoint this is, the control
    mailboxes to the peers it exchanges buckets with (keyed by the peer's Endpoint), its device and
    a timeout for any single wait."""

    plan: TransferPlan
    me: Endpoint
    peers: Mapping[Endpoint, Mailbox]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: float = 600.0
    world: WorldMap | None = None
    #: The version being moved; transports tag their control messages with it so that frames left
    #: over from an aborted version can never be mistaken for the current one.
    version: int = -1

    @property
    def world_map(self) -> WorldMap:
        return self.world or WorldMap(self.plan.num_src, self.plan.num_dst)

    def my_buckets(self) -> list[BucketPlan]:
        """This endpoint's buckets in plan order."""
        if self.me.role == "src":
            return self.plan.buckets_from(self.me.rank)
        return self.plan.buckets_to(self.me.rank)


class Pending(ABC, Generic[T_co]):
    """An operation in flight. `wait` returns its result or raises TransportError."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> T_co: ...


class Done(Pending[T_co]):
    """An already completed operation."""

    def __init__(self, value: T_co) -> None:
        self._value = value

    def wait(self, timeout: float | None = None) -> T_co:
        return self._value


class Transport(ABC):
    """Moves packed buckets between endpoints. See the module docstring for the life cycle."""

    name: ClassVar[str] = "base"
    #: Buckets in flight per endpoint (2 = double buffering: bucket k+1 moves while bucket k loads).
    num_slots: int = 2

    @abstractmethod
    def bind(self, ctx: TransportContext) -> None:
        """Prepare for a version: allocate or reuse slot buffers sized for `ctx.plan`, create groups
        for new broadcast sets (once per generation), remember the peers. Idempotent for one plan."""

    @abstractmethod
    def send_buffer(self, slot: int) -> torch.Tensor:
        """Sender: the reusable 1-d uint8 buffer of slot `slot` to pack a bucket into."""

    @abstractmethod
    def start_send(self, bucket: BucketPlan, slot: int) -> Pending[None]:
        """Sender: start moving `send_buffer(slot)[:bucket.nbytes]` to `bucket.dsts`. The Pending
        completes when the slot may be packed again (every destination has the bytes or released
        them)."""

    @abstractmethod
    def start_recv(self, bucket: BucketPlan, slot: int) -> Pending[torch.Tensor]:
        """Receiver: start receiving `bucket` into slot `slot`; the Pending yields a 1-d uint8 tensor
        of exactly `bucket.nbytes` bytes, valid until `release_recv(bucket, slot)`."""

    @abstractmethod
    def release_recv(self, bucket: BucketPlan, slot: int) -> None:
        """Receiver: done with the bucket's bytes (views into them must be dropped first). IPC closes
        its handle here and tells the owner the memory may be reused."""

    def supports_direct_send(self, data: torch.Tensor) -> bool:
        """Whether `start_send_from` can send from this memory (cheap check before the sender skips
        packing)."""
        return False

    def start_send_from(self, bucket: BucketPlan, data: torch.Tensor) -> Pending[None] | None:
        """Sender, zero-copy: `data` (1-d uint8, bucket.nbytes) already holds the bucket's bytes in
        place (the source tensors are laid out exactly like the bucket, e.g. in a plan arena). Return
        None when this transport cannot send from that memory; the caller then packs a slot. `data`
        must stay unchanged until the Pending completes."""
        return None

    def start_recv_into(self, bucket: BucketPlan, slot: int, out: torch.Tensor) -> Pending[torch.Tensor] | None:
        """Receiver, zero-copy: receive the bucket straight into `out` (1-d uint8, bucket.nbytes: the
        destination tensors laid out exactly like the bucket). Return None when unsupported; the
        caller then receives into a slot and copies. `release_recv` is still called afterwards."""
        return None

    def use_allocator(self, alloc: Callable[[int, torch.device], torch.Tensor]) -> bool:
        """Take slot buffers from `alloc(nbytes, device)` from the next bind on (e.g. shared segments a
        local engine maps, so a received bucket is loaded without a copy). False where this transport's
        buffers cannot come from elsewhere (the caller then copies as usual)."""
        return False

    def abort(self, reason: str) -> None:  # noqa: B027 - optional hook
        """Best effort after a failure: unblock pending operations, release peer resources."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free buffers, handles and groups. The transport is unusable afterwards."""

    def describe(self) -> dict[str, object]:
        """Facts for logs, metrics and the bench JSON (backend, device, group sizes...)."""
        return {"transport": self.name}


#: Registry of transport factories by mode name ("ipc", "nccl", "gdr"), so the agent and the bench
#: choose one by name and extra transports (H7's gdr) register without editing callers.
TRANSPORTS: dict[str, type[Transport]] = {}


def register(name: str) -> Callable[[type[Transport]], type[Transport]]:
    """Class decorator: `@register("ipc") class IpcTransport(Transport): ...`."""

    def deco(cls: type[Transport]) -> type[Transport]:
        TRANSPORTS[name] = cls
        return cls

    return deco
