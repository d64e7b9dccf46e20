"""Fan-out across inference replicas (spec.transfer.fanOut: Relay): a replica forwards what it receives.

Why: with N inference replicas of one layout, every trainer rank sends each version N times, N full
pushes through the trainer pod's network. With Relay the trainer agent of a source rank sends its buckets
to one replica only; that replica's agent forwards every bucket, as soon as it landed and its digest leaves
were checked, to the next replica, which forwards it to the next: a chain. The trainer sends each byte
once, each replica receives it once and sends it at most once, and the chain is pipelined bucket by bucket,
so the last replica has a version about one bucket per hop after the first.

Who relays is decided by the trainer agent of each source rank (transfer/serve.py `WeightServer._dispatch`): the
replicas whose transfers of one (version, source rank, plan) complete their rendezvous within
FANOUT_GATHER_S of the first (waiting only while replicas that asked for the version's metadata lately have not
arrived), and whose destination ranks for that source all live in one pod (so one
agent holds every bucket the source sends). It tells each member its place in the `ws.epoch` frame:

* `relay_to` {group, pod}: forward every bucket of this source to the downstream pod's agent, in the relay
  transport group `group` (`RelayHub.expect`; the receiver holds each bucket until it was forwarded);
* `relay_from` {group, pod}: take this source's buckets from that pod's agent instead (`ws.relay` links to
  its control port, served by `RelayServer`).

What a relay never does:
* forward bytes it did not check: a relayed bucket carries the trainer's digest leaves (and checksums) in
  its `sync.bucket` metadata, and every replica checks them where the bucket landed;
* wait forever for its downstream, or let it fail its own load: the downstream must join within
  RELAY_JOIN_S and each bucket's forward must complete within RELAY_LAG_S, or the relay detaches: its own
  load goes on, the downstream's fetch fails and the downstream's next attempt asks the trainer directly
  (it then offers no relay, `fetcher.fetch_version(relay=False)`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.agent.plan import BucketPlan, TransferPlan
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.sync import SyncError, SyncHooks, SyncStats
from weightsync.agent.transports.base import Pending, Transport, WorldMap
from weightsync.agent.wire import protocol as P
from weightsync.agent.wire.link import Link, LinkError, LinkListener, Mailbox

log = logging.getLogger(__name__)


def _seconds(env: str, default: float) -> float:
    try:
        value = float(os.environ.get(env, default))
    except ValueError:
        return default
    return value if value > 0 else default


#: trainer agent: how long a completed rendezvous waits at most for the other replicas that asked for the same
#: version to arrive before the chain is formed (it waits for nobody else: a replica fetching alone costs nothing;
#: 0.3 s left one of six replicas out now and then on 2 loaded cores, bench/results/*-replicas6-*)
FANOUT_GATHER_S = _seconds("WEIGHTSYNC_FANOUT_GATHER_SECONDS", 1.0)
#: how long a relay waits for its downstream's links, and a downstream's link for its relay's expectation
RELAY_JOIN_S = _seconds("WEIGHTSYNC_RELAY_JOIN_SECONDS", 10.0)
#: how long a relay's receiver waits for one bucket's forward to complete before it detaches the downstream
RELAY_LAG_S = _seconds("WEIGHTSYNC_RELAY_LAG_SECONDS", 30.0)

#: relays (expected or joined, not yet running) one agent keeps: an authenticated peer cannot grow it further
MAX_PENDING_RELAYS = 64

RelayKey = tuple[int, int, str]  # (version, source rank, plan hash)


def relay_group(up: Mapping[str, Any], down: Mapping[str, Any], epoch: str) -> dict[str, Any]:
    """The transport group of one hop, in the same rendezvous store as the replicas' own groups."""
    return {"name": f"relay-{up.get('name')}-{down.get('name')}", "generation": up.get("generation"),
            "store": up.get("store"), "epoch": epoch}


Member = tuple[Mapping[str, Any], str, list[str]]  # a chained replica: (its transfer group, its pod, its proposals)


def chain_links(members: Sequence[Member], epoch: Callable[[list[str]], str]
                ) -> list[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """Each chained replica's (relay_from, relay_to) for its `ws.epoch` frame: member i takes the buckets
    from member i - 1 and passes them to member i + 1, each hop in a relay group of its own whose epoch comes
    from both ends' proposals (so a restart or failure on either end means fresh groups)."""
    hops = []
    for (ug, upod, uprops), (dg, dpod, dprops) in itertools.pairwise(members):
        g = relay_group(ug, dg, epoch([*uprops, *dprops]))
        hops.append(({"group": g, "pod": upod}, {"group": g, "pod": dpod}))
    return [(hops[i - 1][0] if i > 0 else None, hops[i][1] if i < len(hops) else None) for i in range(len(members))]


def parse_hop(value: Any, pods: Mapping[str, str]) -> tuple[dict[str, Any], str, str]:
    """(group, pod, ip) of a `relay_from` / `relay_to` field; ValueError unless it names a pod of this job's
    inference replicas (`pods`: name -> IP) and a well-formed group."""
    if not isinstance(value, dict):
        raise ValueError(f"a relay hop must be an object, got {type(value).__name__}")
    pod, group = value.get("pod"), value.get("group")
    if not isinstance(pod, str) or pod not in pods:
        raise ValueError(f"relay hop names pod {pod!r}, which is not an inference pod of this job")
    if not isinstance(group, dict) or not isinstance(group.get("name"), str) or not isinstance(
            group.get("generation"), int) or not isinstance(group.get("epoch"), str):
        raise ValueError(f"relay hop to {pod} has a malformed group {group!r}")
    store = group.get("store")
    if not (isinstance(store, list) and len(store) == 2 and isinstance(store[0], str) and isinstance(store[1], int)):
        raise ValueError(f"relay hop to {pod} has a malformed store {store!r}")
    if not pods[pod]:
        raise ValueError(f"relay pod {pod} has no IP yet")
    return dict(group), pod, pods[pod]


class RelayDetached(SyncError):
    """The downstream replica was detached (it did not join in time, fell behind or failed)."""


class _SharedPending(Pending[None]):
    """One bucket's forward, waited by the relay's sender (at the end) and by the receiver holding the
    bucket's memory (before it reuses it): whichever waits first waits for the transport, once."""

    def __init__(self, inner: Pending[None]) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            if not self._done:
                try:
                    self._inner.wait(timeout)
                except BaseException as exc:  # every waiter sees the same failure
                    self._error = exc
                self._done = True
            if self._error is not None:
                raise self._error


class RelayStream:
    """The buckets of one source rank as this agent receives them, handed to the relay's WeightSender
    (a sync.BucketStream): `offer` (receiver, after its checks) -> `fill` (sender) -> `sent` (sender,
    the forward in flight) -> `settle` (receiver, before the bucket's memory is reused)."""

    def __init__(self, key: RelayKey, plan: TransferPlan, downstream: str, *, join_s: float | None = None,
                 lag_s: float | None = None) -> None:
        self.key = key
        self.version, self.src, _ = key
        self.plan = plan
        self.downstream = downstream
        self.depth = max(1, len(plan.buckets_from(self.src)))  # the receivers bound what is in flight
        self.join_s = RELAY_JOIN_S if join_s is None else join_s
        self.lag_s = RELAY_LAG_S if lag_s is None else lag_s
        self.created = time.monotonic()
        self.started_at: float | None = None  # when the relay sender started (every downstream link joined)
        self.on_detach: list[Callable[[str], None]] = []
        self._cond = threading.Condition()
        self._offered: dict[int, tuple[torch.Tensor, dict[str, Any] | None]] = {}
        self._pending: dict[int, _SharedPending] = {}
        self._done_meta: tuple[dict[str, Any] | None] | None = None
        self.detached: str | None = None
        self.forwarded_bytes = 0

    # -- the receiver's side -------------------------------------------------------------------------
    def offer(self, bucket: BucketPlan, data: torch.Tensor, meta: dict[str, Any] | None) -> None:
        with self._cond:
            if self.detached is None:
                self._offered[bucket.index] = (data, meta)
                self._cond.notify_all()

    def settle(self, bucket: BucketPlan) -> None:
        """Block until the forward of `bucket` completed (its memory may then be reused), or detach: the
        downstream must have joined within join_s of this relay's start, and take each bucket within lag_s."""
        entered = time.monotonic()
        with self._cond:
            while self.detached is None and bucket.index not in self._pending:
                if self.started_at is None:
                    deadline = self.created + self.join_s
                    why = f"downstream {self.downstream} did not join within {self.join_s:g}s"
                else:
                    deadline = max(entered, self.started_at) + self.lag_s
                    why = f"downstream {self.downstream} did not take bucket {bucket.index} within {self.lag_s:g}s"
                left = deadline - time.monotonic()
                if left <= 0:
                    self._detach_locked(why)
                    break
                self._cond.wait(left)
            pending = self._pending.pop(bucket.index, None)
            self._offered.pop(bucket.index, None)
        if pending is None:
            return
        try:
            pending.wait(self.lag_s)
        except Exception as exc:
            self.detach(f"forwarding bucket {bucket.index} to {self.downstream} did not complete within "
                        f"{self.lag_s:g}s: {exc}")

    def finish(self, meta: dict[str, Any] | None) -> None:
        """The source confirmed the version (its sync.done metadata, forwarded with ours)."""
        with self._cond:
            self._done_meta = (meta,)
            self._cond.notify_all()

    def detach(self, reason: str) -> None:
        with self._cond:
            self._detach_locked(reason)

    def _detach_locked(self, reason: str) -> None:
        if self.detached is None:
            self.detached = reason
            log.warning("relay.detached version=%s src=%s downstream=%s reason=%s", self.version, self.src,
                        self.downstream, reason)
            for cb in self.on_detach:  # unblock the relay sender (its downstream links are aborted)
                try:
                    cb(reason)
                except Exception:
                    log.debug("relay.on_detach failed", exc_info=True)
        self._offered.clear()
        self._cond.notify_all()

    # -- the relay sender's side ---------------------------------------------------------------------
    def _wait_for(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ready():
                if self.detached is not None:
                    raise RelayDetached(f"relay of version {self.version} src {self.src} detached: {self.detached}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RelayDetached(f"{what} did not arrive within {timeout:.0f}s")
                self._cond.wait(left)
            if self.detached is not None:
                raise RelayDetached(f"relay of version {self.version} src {self.src} detached: {self.detached}")

    def fill(self, k: int, bucket: BucketPlan, slot: int) -> torch.Tensor:
        self._wait_for(f"bucket {bucket.index} from upstream", lambda: bucket.index in self._offered, self.lag_s * 2)
        return self._offered[bucket.index][0]

    def meta_of(self, bucket: BucketPlan) -> dict[str, Any] | None:
        with self._cond:
            got = self._offered.get(bucket.index)
        return got[1] if got is not None else None

    def sent(self, bucket: BucketPlan, pending: Pending[None]) -> Pending[None]:
        shared = _SharedPending(pending)
        with self._cond:
            self._pending[bucket.index] = shared
            self.forwarded_bytes += bucket.nbytes
            self._cond.notify_all()
        return shared

    def done_meta(self) -> dict[str, Any] | None:
        self._wait_for("the source's sync.done", lambda: self._done_meta is not None, self.lag_s * 2)
        assert self._done_meta is not None
        return self._done_meta[0]

    def start(self) -> None:
        with self._cond:
            self.started_at = time.monotonic()
            self._cond.notify_all()


class _ForwardHooks(SyncHooks):
    """The relay sender's hooks: each bucket carries the metadata its upstream sent with it (the trainer's
    digest leaves, checksums), unchanged, and so does the end of the version."""

    def __init__(self, stream: RelayStream) -> None:
        self.stream = stream

    def on_send_bucket(self, version: int, bucket: BucketPlan, data: torch.Tensor) -> dict[str, Any] | None:
        return self.stream.meta_of(bucket)

    def on_send_done(self, version: int) -> dict[str, Any] | None:
        return self.stream.done_meta()


class RelayTap:
    """A destination rank's receiver's hook into the relays of its agent (sync.WeightReceiver `tap`).

    Each relayed bucket is offered by one receiver only: the one of the lowest destination rank of the bucket
    (every destination rank of a relayed source lives in this agent, see the module docstring)."""

    def __init__(self, streams: Mapping[int, RelayStream], rank: int) -> None:
        self.streams = dict(streams)
        self.rank = rank

    def _stream(self, bucket: BucketPlan) -> RelayStream | None:
        s = self.streams.get(bucket.src)
        return s if s is not None and min(bucket.dsts) == self.rank else None

    def offer(self, bucket: BucketPlan, data: torch.Tensor, meta: dict[str, Any] | None) -> None:
        s = self._stream(bucket)
        if s is not None:
            s.offer(bucket, data, meta)

    def settle(self, bucket: BucketPlan) -> None:
        s = self._stream(bucket)
        if s is not None:
            s.settle(bucket)

    def done(self, src: int, meta: dict[str, Any] | None) -> None:
        s = self.streams.get(src)
        if s is not None and min(s.plan.dsts_of(src)) == self.rank:
            s.finish(meta)

    def fail(self, reason: str) -> None:
        for s in self.streams.values():
            s.detach(f"this replica's own receive failed: {reason}")


TransportFor = Callable[[dict[str, Any], TransferPlan, str], tuple[Transport, WorldMap | None]]


@dataclass
class _Relay:
    key: RelayKey
    stream: RelayStream | None = None
    group: dict[str, Any] = field(default_factory=dict)
    peers: dict[int, Mailbox] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)
    running: bool = False


class RelayHub:
    """This agent's relays: the expectations its fetches register (`expect`) met by the downstream links
    its RelayServer accepts (`join`); a relay runs once every destination rank of the source joined."""

    def __init__(self, transport_for: TransportFor, *, device: str = "cpu", timeout: float = 600.0,
                 on_forwarded: Callable[[int], None] | None = None, join_s: float | None = None,
                 lag_s: float | None = None) -> None:
        self.transport_for = transport_for
        self.join_s = RELAY_JOIN_S if join_s is None else join_s
        self.lag_s = RELAY_LAG_S if lag_s is None else lag_s
        self.device = device
        self.timeout = timeout
        self.on_forwarded = on_forwarded
        self._lock = threading.Lock()
        self._relays: dict[RelayKey, _Relay] = {}

    def expect(self, version: int, src: int, plan: TransferPlan, group: dict[str, Any], downstream: str) -> RelayStream:
        """A fetch of ours was told to forward source rank `src` (ws.epoch relay_to); its receivers offer
        every bucket to the stream returned."""
        key = (version, src, plan.hash)
        stream = RelayStream(key, plan, downstream, join_s=self.join_s, lag_s=self.lag_s)
        with self._lock:
            self._expire()
            relay = self._relays.setdefault(key, _Relay(key))
            if relay.stream is not None:
                relay.stream.detach("replaced by a newer expectation")
            relay.stream = stream
            relay.group = dict(group)
            wanted = set(plan.dsts_of(src))
            for dst in [d for d in relay.peers if d not in wanted]:  # joined early, for a rank the plan lacks
                mb = relay.peers.pop(dst)
                mb.abort(f"destination rank {dst} receives nothing from source rank {src} in plan {plan.hash[:12]}")
                mb.close()
            run = self._ready(relay)
        if run:
            self._start(relay)
        return stream

    def join(self, key: RelayKey, dst: int, mb: Mailbox) -> None:
        """A downstream destination rank's link (ws.relay) for `key`."""
        with self._lock:
            self._expire()
            if key not in self._relays and len(self._relays) >= MAX_PENDING_RELAYS:
                mb.abort(f"this agent already has {MAX_PENDING_RELAYS} relays pending")
                mb.close()
                return
            relay = self._relays.setdefault(key, _Relay(key))
            if relay.stream is not None and dst not in relay.stream.plan.dsts_of(key[1]):
                mb.abort(f"destination rank {dst} receives nothing from source rank {key[1]} in plan {key[2][:12]}")
                mb.close()
                return
            if relay.running:
                mb.abort(f"the relay of version {key[0]} from source rank {key[1]} has started without it")
                mb.close()
                return
            old = relay.peers.get(dst)
            if old is not None:
                old.close()
            relay.peers[dst] = mb
            run = self._ready(relay)
        if run:
            self._start(relay)

    def _ready(self, relay: _Relay) -> bool:
        if relay.running or relay.stream is None or relay.stream.detached is not None:
            return False
        if set(relay.peers) != set(relay.stream.plan.dsts_of(relay.key[1])):
            return False
        relay.running = True
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        for key, relay in list(self._relays.items()):
            if relay.running:
                continue
            if now - relay.created > self.join_s or (relay.stream is not None and relay.stream.detached):
                del self._relays[key]
                if relay.stream is None:
                    why = (f"no relay of version {key[0]} from source rank {key[1]} (plan {key[2][:12]}) is expected "
                           f"here: the upstream's own transfer did not ask for one within {self.join_s:g}s")
                else:
                    why = relay.stream.detached or (f"downstream {relay.stream.downstream} did not join within "
                                                    f"{self.join_s:g}s")
                for mb in relay.peers.values():
                    mb.abort(why)
                    mb.close()
                if relay.stream is not None:
                    relay.stream.detach(why)

    def _start(self, relay: _Relay) -> None:
        threading.Thread(target=self._run, args=(relay,), daemon=True,
                         name=f"relay-v{relay.key[0]}-src{relay.key[1]}").start()

    def _run(self, relay: _Relay) -> None:
        stream = relay.stream
        assert stream is not None
        version, src, _ = relay.key
        t0 = time.perf_counter()
        try:
            for mb in relay.peers.values():
                mb.send(P.EPOCH, src=src, epoch=relay.group.get("epoch"))
            stream.on_detach.append(lambda why: self._cut(relay, why))
            stream.start()
            transport, world = self.transport_for(relay.group, stream.plan, f"relay-src{src}")
            sender = WeightSender(stream.plan, src, transport, relay.peers, timeout=self.timeout, world=world,
                                  device=self.device, hooks=_ForwardHooks(stream))
            stats: SyncStats = sender.send_version(version, {}, stream=stream)
        except (SyncError, LinkError, OSError) as exc:
            stream.detach(f"the relay sender failed: {exc}")
            for mb in relay.peers.values():
                mb.abort(str(exc))
            return
        finally:
            for mb in relay.peers.values():
                mb.close()
            with self._lock:
                if self._relays.get(relay.key) is relay:
                    del self._relays[relay.key]
        if self.on_forwarded is not None:
            self.on_forwarded(stats.bytes)
        log.info("relay.done version=%s src=%s downstream=%s bytes=%s seconds=%.3f", version, src,
                 stream.downstream, stats.bytes, time.perf_counter() - t0)

    @staticmethod
    def _cut(relay: _Relay, why: str) -> None:
        """A detached relay: tell the downstream and close its links, so the relay sender stops waiting."""
        for mb in relay.peers.values():
            mb.abort(f"the relay detached this replica: {why}")
            mb.close()

    def sweep(self) -> None:
        """Abort links and expectations that waited longer than RELAY_JOIN_S for their other half."""
        with self._lock:
            self._expire()

    def close(self) -> None:
        with self._lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            if relay.stream is not None:
                relay.stream.detach("the agent is stopping")
            for mb in relay.peers.values():
                mb.close()


class RelayServer:
    """An inference agent's listener for its downstream replicas' `ws.relay` links (the control port, which
    a pod that serves no trainer rank does not otherwise use), behind the job token."""

    def __init__(self, host: str, port: int, token: bytes, hub: RelayHub, *, on_reject: Callable[[str], None]
                 | None = None) -> None:
        self.hub = hub
        self.on_reject = on_reject
        self.listener = LinkListener(host, port, token)
        self.port = self.listener.port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.listener.serve, args=(self._handle, self._stop, "relay-peer"),
                                        name="relay-accept", daemon=True)

    def start(self) -> RelayServer:
        self._thread.start()
        threading.Thread(target=self._sweep, name="relay-sweep", daemon=True).start()
        log.info("relay server listening port=%s", self.port)
        return self

    def _sweep(self) -> None:
        while not self._stop.wait(1.0):
            self.hub.sweep()

    def _handle(self, link: Link) -> None:
        try:
            h, _ = link.recv(timeout=30)
            if h.get("kind") != P.RELAY:
                raise P.ProtocolError(f"this agent serves only {P.RELAY} links, got {h.get('kind')!r}")
            key = (P.require(h, "version", int), P.require(h, "src", int), P.require(h, "plan_hash", str))
            dst = P.require(h, "dst", int)
            if key[0] < 1 or key[1] < 0 or dst < 0 or len(key[2]) > 128:
                raise P.ProtocolError(f"bad relay request version={key[0]} src={key[1]} dst={dst}")
        except (LinkError, P.ProtocolError) as exc:
            log.warning("relay.reject peer=%s reason=%s", link.peer, exc)
            if self.on_reject is not None:
                self.on_reject("protocol")
            with contextlib.suppress(LinkError):
                link.send({"kind": P.ERROR, "message": str(exc)})
            link.close()
            return
        self.hub.join(key, dst, Mailbox(link, name=f"relay-dst{dst}@{link.peer}"))

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self.hub.close()
