"""Transports per transport group, created once per (group, membership generation, epoch) and reused.

Why an epoch on top of the generation: an agent container can restart without its pod's IP changing,
so the operator keeps the generation, yet the process groups of the dead process are useless. Every
inference agent proposes an epoch with each transfer (its session, the trainer agents' sessions, and a
counter it bumps after every failed fetch); the trainer agent of each source rank combines the
proposals of all destinations into the epoch (`ws.epoch`), and both ends key their transports by it,
so a restart or a failure always leads to fresh groups on every member instead of a hang on a stale one.

NCCL mode: the first member of each group (trainer pod 0) hosts the rendezvous store on its transport
port, behind the job token (transports/rendezvous.py: torch's TCPStore would let anyone read and write it); all
groups live under `<job>/<group>/g<generation>/<epoch>/` prefixes in it. IPC mode needs no store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync.agent.plan import BucketPlan, TransferPlan
from weightsync.agent.staging import segments
from weightsync.agent.staging.slots import ReceiveSlots
from weightsync.agent.transports.base import (
    TRANSPORTS,
    Pending,
    Transport,
    TransportContext,
    TransportError,
    WorldMap,
)
from weightsync.agent.transports.delta import DeltaConfig
from weightsync.agent.transports.ipc import IpcTransport
from weightsync.agent.transports.nccl import NcclTransport
from weightsync.agent.transports.rendezvous import LinkStore, StoreServer
from weightsync.crds import contract
from weightsync.crds.topology import Topology, TransportGroup

log = logging.getLogger(__name__)

KEEP_PER_GROUP = 2  # transports kept per group name (the current epoch and the one before)
#: relay hops (agent/transfer/relay.py, groups `relay-<up>-<down>`) kept per agent, least recently used first out, once
#: idle for the transfer timeout (a hop is never closed under a transfer that may still use it): an agent is in
#: at most two hops of a chain (from its upstream, to its downstream), so this keeps the current chain's and the
#: one before; a membership that churns would otherwise keep a group for every pair it was ever in
KEEP_RELAY_GROUPS = 4
RELAY_GROUP_PREFIX = "relay-"


def proposal_of(session: str, attempt: int, trainer_sessions: Sequence[str], relay_evictions: int = 0) -> str:
    """An inference agent's epoch proposal: new whenever it restarts, fails, a trainer agent restarts, or it
    closed a relay hop's transports (TransportCache: its peer on that hop may still hold its own end, which
    must never be paired again with a fresh one under the same epoch)."""
    doc = "|".join([session, str(attempt), *sorted(trainer_sessions), *([f"r{relay_evictions}"] if relay_evictions else [])])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def epoch_of(trainer_session: str, src: int, proposals: Sequence[str], failures: int) -> str:
    """The epoch a source rank's groups use for one transfer: decided by the trainer agent from every
    destination's proposal, so all members of a group (several inference pods included) agree on it."""
    doc = "|".join([trainer_session, str(src), str(failures), *sorted(proposals)])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


class RoutingTransport(Transport):
    """Receive side over one transport per source rank (each source's groups live under the epoch its
    trainer agent chose). Each inner transport is bound to the part of the plan its source sends."""

    name = "routed"

    def __init__(self, by_src: dict[int, Transport], slots: ReceiveSlots | None = None) -> None:
        """`slots`: the destination's receive buffers, shared by every source (each bucket is received into
        one where its transport can receive into given memory); None: each source's transport uses its own."""
        self.by_src = by_src
        self.slots = slots
        self.num_slots = min((t.num_slots for t in by_src.values()), default=2)

    def bind(self, ctx: TransportContext) -> None:
        if self.slots is not None:
            need = max((b.nbytes for b in ctx.plan.buckets_to(ctx.me.rank)), default=0)
            self.slots.ensure(self.num_slots, max(need, 1), ctx.device)
        for s, t in self.by_src.items():
            sub = dataclasses.replace(ctx.plan, buckets=tuple(b for b in ctx.plan.buckets if b.src == s))
            # only its own source's link: a transport that greets every peer at bind (GDR reads a hello
            # from each) would otherwise take the frames meant for the other sources' transports
            peers = {ep: mb for ep, mb in ctx.peers.items() if ep.role != "src" or ep.rank == s}
            t.bind(dataclasses.replace(ctx, plan=sub, peers=peers))

    def send_buffer(self, slot: int) -> torch.Tensor:
        raise TransportError("a routing transport only receives")

    def start_send(self, bucket: BucketPlan, slot: int) -> Pending[None]:
        raise TransportError("a routing transport only receives")

    def _of(self, bucket: BucketPlan) -> Transport:
        t = self.by_src.get(bucket.src)
        if t is None:
            raise TransportError(f"no transport for source rank {bucket.src} (bucket {bucket.index})")
        return t

    def start_recv(self, bucket: BucketPlan, slot: int) -> Pending[torch.Tensor]:
        t = self._of(bucket)
        if self.slots is not None:
            pending = t.start_recv_into(bucket, slot, self.slots.get(slot)[: bucket.nbytes])
            if pending is not None:
                return pending
        return t.start_recv(bucket, slot)

    def release_recv(self, bucket: BucketPlan, slot: int) -> None:
        self._of(bucket).release_recv(bucket, slot)

    @property
    def can_refetch(self) -> bool:
        """Whether every source's transport can read a bucket again (GDR's one-sided READ can; push
        transports cannot), so `verify: Checksum` retries a mismatch instead of failing the version."""
        return bool(self.by_src) and all(callable(getattr(t, "refetch", None)) for t in self.by_src.values())

    def refetch(self, bucket: BucketPlan) -> torch.Tensor:
        """Read `bucket` again through its source's transport (after a checksum mismatch)."""
        fn = getattr(self._of(bucket), "refetch", None)
        if fn is None:
            raise TransportError(f"the transport of source rank {bucket.src} cannot read bucket {bucket.index} again")
        result: torch.Tensor = fn(bucket)
        return result

    def abort(self, reason: str) -> None:
        for t in self.by_src.values():
            t.abort(reason)

    def describe(self) -> dict[str, object]:
        return {"transport": self.name, "sources": {s: t.describe() for s, t in self.by_src.items()}}


def default_groups(topo: Topology) -> list[TransportGroup]:
    """The operator's convention when a topology lists no groups: one group per inference replica."""
    trainers = [p.name for p in topo.trainer.pods]
    out = []
    for rep in topo.inference:
        out.append(TransportGroup(name=f"replica-{rep.replica}",
                                  members=trainers + [p.name for p in rep.pods if p.name not in trainers]))
    return out


def group_for(topo: Topology, replica: int, pod: str) -> TransportGroup:
    """The transport group a replica's transfers use: the group holding this pod and the replica's pods."""
    rep = next((r for r in topo.inference if r.replica == replica), None)
    if rep is None:
        raise ValueError(f"replica {replica} is not in the topology")
    wanted = {p.name for p in rep.pods} | {pod}
    for g in topo.groups or default_groups(topo):
        if wanted <= set(g.members):
            return g
    for g in default_groups(topo):
        if g.name == f"replica-{replica}":
            return g
    raise ValueError(f"no transport group holds pods {sorted(wanted)}")


class TransportCache:
    """The transports this agent uses, by (group, generation, epoch).

    Reuse matters for delta sync (`delta`, GDR only): each GDR transport keeps the previous version's bucket
    bytes as the base of the next delta, so the same transport must serve one group version after version.
    A new generation or epoch means a new transport with an empty base: its first version is sent in full.
    GDR transports share one NIXL agent per process (nixl_endpoint.NixlEndpoint says why); it is closed with the cache."""

    def __init__(self, *, mode: str, job: str, pod_ip: str, transport_port: int, timeout: float = 600.0,
                 shm_prefix: str = "weightsync", delta: DeltaConfig | None = None,
                 token: bytes | None = None) -> None:
        self.token = token
        self.mode = mode
        self.delta = delta if mode == "GDR" else None
        self.job = job
        self.pod_ip = pod_ip
        self.transport_port = transport_port
        self.timeout = timeout
        self.shm_prefix = shm_prefix
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, int, str, str], Transport] = {}
        self._order: list[tuple[str, int, str, str]] = []
        self._relays: dict[str, float] = {}  # relay group name -> when last used (monotonic), least recent first
        self.relay_evictions = 0  # relay hops closed so far: part of this agent's epoch proposal (proposal_of)
        self._master: StoreServer | None = None
        self._nixl: Any = None  # GDR: the one NIXL agent of this process, shared by its transports

    def _job_token(self) -> bytes:
        if not self.token:
            raise ValueError("NCCL mode needs the job token: the rendezvous store accepts no one without it")
        return self.token

    def host_store(self) -> None:
        """Trainer pod 0 in NCCL mode: host the rendezvous store every group of the job uses, on the pod IP
        only and behind the job token."""
        if self.mode != "NCCL" or self._master is not None:
            return
        try:
            self._master = StoreServer(self.pod_ip, self.transport_port, self._job_token(), timeout=self.timeout)
        except OSError as exc:
            raise OSError(f"cannot host the rendezvous store on {self.pod_ip}:{self.transport_port}: {exc} "
                          f"(another process holds the transport port; set {contract.ENV_TRANSPORT_PORT})") from exc
        log.info("rendezvous store hosted at %s:%s (authenticated)", self.pod_ip, self.transport_port)

    def get(self, group: dict[str, Any], plan: TransferPlan, *, role: str) -> tuple[Transport, WorldMap | None]:
        """The transport for `group` ({name, generation, epoch, store: [host, port]}), created on first use.
        Sender and receiver ends are separate transports even in one (colocated) process."""
        key = (str(group["name"]), int(group["generation"]), str(group["epoch"]), role)
        with self._lock:
            if key[0].startswith(RELAY_GROUP_PREFIX):
                now = time.monotonic()
                self._relays.pop(key[0], None)
                self._relays[key[0]] = now
                for name in list(self._relays)[:-KEEP_RELAY_GROUPS]:
                    if now - self._relays[name] < self.timeout:
                        break  # this and every later one may still be in use by a transfer
                    del self._relays[name]
                    self.relay_evictions += 1
                    self._close([k for k in self._order if k[0] == name], "relay hop no longer used")
            t = self._cache.get(key)
            if t is not None:
                return t, None
            t = self._create(group, key)
            self._cache[key] = t
            self._order.append(key)
            same = [k for k in self._order if k[0] == key[0] and k[3] == role]
            self._close(same[:-KEEP_PER_GROUP], None)
            return t, None

    def _close(self, keys: list[tuple[str, int, str, str]], abort: str | None) -> None:
        """Forget and close these transports (under the lock); `abort`: abort each first with this reason."""
        for k in keys:
            self._order.remove(k)
            t = self._cache.pop(k)
            try:
                if abort is not None:
                    t.abort(abort)
                t.close()
            except Exception:
                log.debug("closing a transport failed", exc_info=True)

    def _create(self, group: dict[str, Any], key: tuple[str, int, str, str]) -> Transport:
        if self.mode == "IPC":
            return IpcTransport(prefix=self.shm_prefix, shm_dir=str(segments.shm_dir()))  # the pod's staging volume
        if self.mode == "NCCL":
            host, port = group["store"]
            base = LinkStore(str(host), int(port), self._job_token(), timeout=self.timeout)
            store = dist.PrefixStore(f"{self.job}/{key[0]}/g{key[1]}/{key[2]}/", base)
            return NcclTransport(store, generation=key[1], host=self.pod_ip, timeout=self.timeout, owned=base)
        if self.mode == "GDR":
            # imported only here so other modes never need NIXL installed (it also registers "gdr")
            from weightsync.agent.transports.gdr import GdrTransport
            from weightsync.agent.transports.nixl_endpoint import NixlEndpoint

            if self._nixl is None:
                self._nixl = NixlEndpoint()
            return GdrTransport(delta=self.delta, endpoint=self._nixl)
        factory = TRANSPORTS.get(self.mode.lower())
        if factory is None:
            raise ValueError(f"transfer mode {self.mode} has no transport (known: {sorted(TRANSPORTS)})")
        return factory()

    def drop(self, group_name: str, role_prefix: str = "") -> None:
        """Forget a group's transports whose role starts with `role_prefix` (after a failed fetch: the next
        attempt gets a new epoch anyway, so they would never be used again)."""
        with self._lock:
            self._close([k for k in self._order if k[0] == group_name and k[3].startswith(role_prefix)], "dropped")

    def close(self) -> None:
        with self._lock:
            for t in self._cache.values():
                try:
                    t.close()
                except Exception:
                    log.debug("closing a transport failed", exc_info=True)
            self._cache.clear()
            self._order.clear()
            self._relays.clear()
            if self._nixl is not None:
                self._nixl.close()
                self._nixl = None
            if self._master is not None:
                self._master.close()
                self._master = None
