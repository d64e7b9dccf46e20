"""The weight server of a trainer agent: announce staged versions and serve them to inference agents.

Inference agents open control links (announcements, metadata, their served reports) and per-version
transfer links; for each source rank the server waits until every destination of the plan joined (a
rendezvous), then runs a WeightSender (agent/transfer/send.py) over the replica's transport, reading the
version from the staged versions (agent/staging/versions.py). A bad peer never takes the server down:
every link is handled in its own thread and every failure is logged and counted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.plan import TransferPlan
from weightsync.agent.staging import segments
from weightsync.agent.staging.index import PublishedIndex, StagingError
from weightsync.agent.staging.ring import RingError
from weightsync.agent.staging.versions import SentLeaves, StagedVersion, StagedVersions
from weightsync.agent.transfer.digest import HASHED_HERE, DigestHooks
from weightsync.agent.transfer.groups import epoch_of
from weightsync.agent.transfer.relay import FANOUT_GATHER_S, chain_links
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.served import ServedTracker
from weightsync.agent.transfer.sync import SyncError, SyncStats
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

log = logging.getLogger(__name__)

PIN_SECONDS = 60.0           # how long a metadata request keeps a version staged for the transfer to follow
RENDEZVOUS_TIMEOUT = 60.0    # how long a source waits for every destination of a plan to join
ASKING_WINDOW_S = 30.0       # fanOut Relay: a replica that asked for a version's metadata this recently fetches it

#: A replica's transport for one source rank: (its group, the plan, the endpoint's name) -> (transport, world map)
TransportFor = Callable[[dict[str, Any], TransferPlan, str], tuple[Transport, WorldMap | None]]


def _share(transport: Transport, seg: segments.Segment) -> None:
    """Register a shared-memory segment with a transport that hands buckets out of it (IPC: `register_shared`,
    which the Transport interface does not have), so its buckets are sent from there without a copy."""
    register = getattr(transport, "register_shared", None)
    if isinstance(seg, segments.ShmSegment) and callable(register):
        register(str(seg.path), seg.tensor)


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

    def __init__(self, *, host: str, port: int, token: bytes, pod: str, store: StagedVersions,
                 transport_for: TransportFor,
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
            assert relay_from is not None  # every member after the first takes from the one before it
            self._redirect(member, relay_from, relay_to)
        self._send(chain[0], relay_to=links[0][1])

    def _redirect(self, rdv: _Rendezvous, relay_from: dict[str, Any], relay_to: dict[str, Any] | None) -> None:
        """Tell a chained replica to take this source's buckets from the replica before it (and pass them to
        the one after it); this source sends it nothing."""
        extra: dict[str, Any] = {"relay_from": relay_from, **({"relay_to": relay_to} if relay_to else {})}
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
        extra: dict[str, Any] = {"relay_to": relay_to} if relay_to else {}
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
                    _share(transport, rs.slot.segment)  # IPC hands buckets out of staging
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

    def _send_streamed(self, rdv: _Rendezvous, transport: Transport, sender: WeightSender) -> SyncStats:
        """Ring mode: stream the version through a ring of bucket slots the trainer process fills
        (agent/staging/ring.py); the ring goes back to the pool when the transfer ends, also when it fails."""
        ring = self.store.ring
        if ring is None:
            raise StagingError(f"version {rdv.version} was streamed but this agent has no ring")
        with ring.source(rdv.plan, rdv.src, rdv.version, self.timeout) as source:
            _share(transport, source.segment)  # IPC hands buckets out of the ring
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

