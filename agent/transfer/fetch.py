"""Inference side of the agent: follow the trainer agents, fetch a version's slices, hand them to the engine.

`TrainerPeers` keeps one control link per trainer pod (hello, announcements, metadata requests) and
reconnects when a trainer agent restarts. `fetch_version` computes the plan for this agent's replica,
opens one transfer link per (source rank, destination rank), receives with WeightReceiver and feeds the
buckets to the engine adapter through `load_version`, so pause/resume/commit/abort follow the adapter
contract: the engine commits only after every bucket arrived and every source confirmed the version.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from weightsync.agent.engines.base import EngineAdapter, NamedTensors, RankRouter, load_version
from weightsync.agent.layout.rules import LayoutError, TensorMeta, inference_layout
from weightsync.agent.plan import ShardTable, TensorShard, TransferPlan
from weightsync.agent.plan.cache import PLANS
from weightsync.agent.staging.slots import ReceiveSlots, SharedSlotAllocator
from weightsync.agent.transfer.digest import Digest, DigestHooks
from weightsync.agent.transfer.groups import RoutingTransport
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.relay import RELAY_JOIN_S, RelayHub, RelayStream, RelayTap, parse_hop
from weightsync.agent.transfer.sync import PlacedTensors, SyncStats
from weightsync.agent.transfer.verify import ChecksumHooks
from weightsync.agent.transports.base import Transport, WorldMap
from weightsync.agent.wire import protocol as P
from weightsync.agent.wire.link import Link, LinkError, LinkTimeout, Mailbox, connect
from weightsync.crds.topology import PodMember, Topology

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    """A version could not be fetched; nothing was committed. The message says why."""


@dataclass
class _Peer:
    member: PodMember
    link: Link | None = None
    latest: int | None = None
    trainer_epoch: int = 0  # the trainer epoch of `latest`
    ranks: list[int] = field(default_factory=list)
    session: str = ""
    pending: dict[int, Future[tuple[dict[str, Any], bytes]]] = field(default_factory=dict)
    thread: threading.Thread | None = None


class TrainerPeers:
    """Control links to every trainer pod of the topology."""

    def __init__(self, topo: Topology, *, port: int, token: bytes, pod: str, replica: int,
                 on_announce: Callable[[], None]) -> None:
        self.port = port
        self.token = token
        self.pod = pod
        self.replica = replica
        self.on_announce = on_announce
        self.session = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._peers: dict[str, _Peer] = {}
        # the last version (and its trainer epoch) this agent committed into its engine, told to every
        # trainer agent (ws.served)
        self._served: tuple[int, int] | None = None
        self._served_lock = threading.Lock()
        self.update(topo)

    def update(self, topo: Topology) -> None:
        """Follow a new topology: new trainer pods get a link, changed IPs reconnect, removed pods close."""
        with self._lock:
            want = {m.name: m for m in topo.trainer.pods}
            for name in list(self._peers):
                p = self._peers[name]
                if name not in want or want[name].ip != p.member.ip:
                    if p.link is not None:
                        p.link.close()
                    del self._peers[name]
            for name, m in want.items():
                if name not in self._peers:
                    peer = _Peer(m)
                    self._peers[name] = peer
                    peer.thread = threading.Thread(target=self._run, args=(peer,), name=f"trainer-link-{name}",
                                                   daemon=True)
                    peer.thread.start()

    def _alive(self, peer: _Peer) -> bool:
        with self._lock:
            return not self._stop.is_set() and self._peers.get(peer.member.name) is peer

    def _run(self, peer: _Peer) -> None:
        delay = 0.1
        while self._alive(peer):
            ip = peer.member.ip
            if not ip:
                time.sleep(0.5)
                continue
            try:
                link = connect(ip, self.port, self.token, timeout=5.0)
                link.send({"kind": P.HELLO, "pod": self.pod, "replica": self.replica, "session": self.session})
                h, _ = link.recv(timeout=30)
                if h.get("kind") != P.WELCOME:
                    raise P.ProtocolError(f"trainer {peer.member.name} answered hello with {h.get('kind')!r}")
                peer.ranks = [int(r) for r in h.get("ranks", [])]
                peer.latest = h.get("latest") if isinstance(h.get("latest"), int) else None
                epoch = h.get("trainer_epoch", 0)
                peer.trainer_epoch = epoch if isinstance(epoch, int) and epoch >= 0 else 0
                peer.session = str(h.get("session", ""))
                peer.link = link
                delay = 0.1
                log.info("trainer.connected pod=%s ranks=%s latest=%s", peer.member.name, peer.ranks, peer.latest)
                with self._served_lock:  # a new link (or a restarted trainer agent) learns what we serve
                    if self._served is not None:
                        link.send({"kind": P.SERVED, "version": self._served[1], "trainer_epoch": self._served[0]})
                self.on_announce()
                self._read(peer, link)
            except (LinkError, OSError, P.ProtocolError) as exc:
                if self._alive(peer):
                    log.info("trainer.link_down pod=%s: %s", peer.member.name, exc)
            finally:
                if peer.link is not None:
                    peer.link.close()
                peer.link = None
                for fut in peer.pending.values():
                    if not fut.done():
                        fut.set_exception(FetchError(f"control link to {peer.member.name} lost"))
                peer.pending.clear()
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _read(self, peer: _Peer, link: Link) -> None:
        while self._alive(peer):
            try:
                h, payload = link.recv(timeout=1.0)
            except LinkTimeout:
                continue
            kind = h.get("kind")
            if kind == P.ANNOUNCE and isinstance(h.get("version"), int):
                epoch = h.get("trainer_epoch", 0)
                epoch = epoch if isinstance(epoch, int) and epoch >= 0 else 0
                if epoch > peer.trainer_epoch:  # a restarted trainer: its versions count from its first one
                    peer.trainer_epoch, peer.latest = epoch, h["version"]
                elif epoch == peer.trainer_epoch:
                    peer.latest = max(peer.latest or 0, h["version"])
                self.on_announce()
            elif kind in (P.META, P.ERROR) and isinstance(h.get("id"), int):
                fut = peer.pending.pop(h["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result((h, bytes(payload)))
            else:
                log.warning("trainer.unexpected_frame pod=%s kind=%r", peer.member.name, kind)

    def report_served(self, version: int, trainer_epoch: int = 0) -> None:
        """Tell every trainer agent that this agent committed `version` into its engine (ws.served), now and
        after every reconnect. Only versions this agent loaded itself are reported, never a version the
        engine claims (an app container could claim anything): trainer agents answer wait_served from these.
        0 withdraws the report: the engine holds no complete version (a failed load whose restore failed)."""
        with self._served_lock:
            self._served = (trainer_epoch, version)
            with self._lock:
                links = [(p.member.name, p.link) for p in self._peers.values() if p.link is not None]
            for name, link in links:
                try:
                    link.send({"kind": P.SERVED, "version": version, "trainer_epoch": trainer_epoch})
                except LinkError as exc:  # the reconnect sends it again
                    log.info("served report to %s failed: %s", name, exc)

    def latest_available(self) -> tuple[int, int] | None:
        """(trainer epoch, version): the newest version every trainer pod has staged (None until all of them
        announced one in the same trainer epoch)."""
        with self._lock:
            peers = list(self._peers.values())
        if not peers or any(p.latest is None or p.link is None for p in peers):
            return None
        if len({p.trainer_epoch for p in peers}) != 1:
            return None  # some trainer pods restarted, others not yet: wait until all are in one epoch
        return peers[0].trainer_epoch, min(int(p.latest) for p in peers if p.latest is not None)

    def newest_announced(self) -> int | None:
        with self._lock:
            vs = [p.latest for p in self._peers.values() if p.latest is not None]
        return max(vs) if vs else None

    def trainer_sessions(self) -> list[str]:
        with self._lock:
            return sorted(p.session for p in self._peers.values())

    def connected(self) -> bool:
        with self._lock:
            return bool(self._peers) and all(p.link is not None for p in self._peers.values())

    def meta(self, version: int, timeout: float = 30.0) -> tuple[dict[int, Sequence[TensorShard]], dict[str, str]]:
        """Every trainer rank's shards of `version` (pins it on the trainers for the transfer to follow)."""
        with self._lock:
            peers = list(self._peers.values())
        futs = []
        for p in peers:
            link = p.link
            if link is None:
                raise FetchError(f"no control link to trainer pod {p.member.name} yet")
            rid = next(self._ids)
            fut: Future[tuple[dict[str, Any], bytes]] = Future()
            p.pending[rid] = fut
            try:
                link.send({"kind": P.META_REQ, "id": rid, "version": version})
            except LinkError as exc:
                raise FetchError(f"asking trainer pod {p.member.name} for version {version}: {exc}") from None
            futs.append((p, fut))
        ranks: dict[int, Sequence[TensorShard]] = {}
        aliases: dict[str, str] = {}
        for p, fut in futs:
            try:
                h, payload = fut.result(timeout)
            except TimeoutError:
                raise FetchError(f"trainer pod {p.member.name} did not answer a metadata request in {timeout}s") from None
            if h.get("kind") == P.ERROR or not h.get("ok"):
                raise FetchError(f"trainer pod {p.member.name}: {h.get('error') or h.get('message')}")
            r, a = P.decode_meta(payload)
            ranks.update(r)
            aliases.update(a)
        return ranks, aliases

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for p in self._peers.values():
                if p.link is not None:
                    p.link.close()


class RankedBucket(PlacedTensors):
    """One bucket's (name, tensor) pairs plus the destination rank they belong to (several inference
    ranks can share one agent; adapters that care read `.rank`) and, for an engine that loads pieces,
    where each piece goes (`.places`, see PlacedTensors)."""

    def __init__(self, tensors: NamedTensors, rank: int) -> None:
        super().__init__(tensors, getattr(tensors, "places", None), getattr(tensors, "flat", None))
        self.rank = rank


def loads_pieces(adapter: EngineAdapter) -> bool:
    """Whether the engine loads a tensor's pieces into place itself (a Custom engine whose every rank passed
    `on_pieces`): then nothing is assembled in the agent."""
    ask = getattr(adapter, "loads_pieces", None)
    return bool(ask()) if callable(ask) else False


def with_aliases(tensors: NamedTensors, alias_of: dict[str, list[str]]) -> PlacedTensors:
    """The pairs plus every alias of their tensors (a piece's alias is the same piece, in the same place)."""
    places = getattr(tensors, "places", {})
    out = PlacedTensors(tensors, places)
    for i, (n, t) in enumerate(tensors):
        for a in alias_of.get(n, []):
            if i in places:
                out.places[len(out)] = places[i]
            out.append((a, t))
    return out


class _BucketPipe:
    """Hands buckets from the receiver threads (one per local destination rank) to `load_version`'s loop.

    A receiver's views are only valid until its callback returns, so `push` blocks until the engine
    loaded that bucket (the generator resumed) or the consumer gave up (`cancel`; then push raises)."""

    _END = object()

    def __init__(self, producers: int) -> None:
        self._q: queue.Queue[Any] = queue.Queue()
        self._cancelled = threading.Event()
        self._left = producers
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def push(self, tensors: NamedTensors, rank: int) -> None:
        if self._cancelled.is_set():
            raise FetchError("the engine stopped loading this version")
        done = threading.Event()
        self._q.put((RankedBucket(tensors, rank), done))
        while not done.wait(0.5):
            if self._cancelled.is_set():
                break
        if self._cancelled.is_set():
            raise FetchError("the engine failed to load a bucket of this version")

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._left -= 1
            if error is not None and self.error is None:
                self.error = error
            last = self._left == 0 or error is not None
        if last:
            self._q.put((self._END, None))

    def cancel(self) -> None:
        self._cancelled.set()

    def __iter__(self) -> Iterator[NamedTensors]:
        while True:
            item, done = self._q.get()
            if item is self._END:
                if self.error is not None:
                    raise self.error
                return
            yield item
            # The engine loaded it; drop every reference to the receiver's views before it reuses (or,
            # for IPC, unmaps) the buffer: the caller's loop variable is this same list object.
            item.clear()
            item.flat = None  # it holds the bucket's bytes too
            del item
            done.set()


def compute_needs(names: dict[str, TensorShard], world: int, tensor_parallel: int,
                  layout_fn: Callable[[dict[str, TensorShard], int, int], list[list[TensorShard]]] | None
                  ) -> list[list[TensorShard]]:
    """Every destination rank's needed boxes for a replica of `world` ranks (default: the HF TP rules of
    agent/layout/rules.py; tied embeddings were already published once, under one name)."""
    if layout_fn is not None:
        return layout_fn(names, world, tensor_parallel)
    if world != tensor_parallel:
        raise FetchError(f"inference replica of {world} ranks with tensor parallelism {tensor_parallel}: only "
                         "pure tensor parallelism (world == tensor) has a default layout")
    metas = [TensorMeta(n, s.dtype, s.global_shape) for n, s in sorted(names.items())]
    try:
        return [inference_layout(metas, tensor_parallel, r) for r in range(world)]
    except LayoutError as exc:
        raise FetchError(f"cannot lay out the model for TP {tensor_parallel}: {exc}") from None


@dataclass
class FetchResult:
    version: int
    bytes: int
    seconds: float
    stats: list[SyncStats]
    verified_bytes: int = 0
    digest: str = ""  # the version's content digest as this agent received it (agent/transfer/digest.py)
    digest_checked: bool = True  # every piece was checked against its sender's leaf
    digest_bytes: int = 0  # bytes this agent hashed where they landed
    digest_reused_bytes: int = 0  # bytes that landed where this agent's own sender hashed them (IPC, colocated)
    relayed_from: list[str] = field(default_factory=list)  # fanOut Relay: the upstream pods buckets came from


def reachable_sources(topo: Topology, group_name: str) -> set[int] | None:
    """The trainer ranks an IPC destination can read: those on the pods of its transport group. None for
    the network transports (NCCL, GDR), which reach every rank."""
    if topo.mode != "IPC":
        return None
    g = next((g for g in topo.groups if g.name == group_name), None)
    if g is None:
        return None
    members = set(g.members)
    return {r for m in topo.trainer.pods if m.name in members for r in m.ranks}


_RECEIVE_SLOTS: dict[tuple[int, SharedSlotAllocator | None], ReceiveSlots] = {}
_SLOTS_LOCK = threading.Lock()


def receive_slots(rank: int, alloc: SharedSlotAllocator | None) -> ReceiveSlots:
    """The receive buffers of local destination rank `rank`, kept across versions (and transports)."""
    key = (rank, alloc)
    with _SLOTS_LOCK:
        slots = _RECEIVE_SLOTS.get(key)
        if slots is None:
            slots = _RECEIVE_SLOTS[key] = ReceiveSlots(alloc)
        return slots


TransportFor = Callable[[dict[str, Any], TransferPlan, str], tuple[Transport, WorldMap | None]]
EPOCH_TIMEOUT = 90.0  # the trainer answers with the epoch once every destination of its rank joined


def _epochs(version: int, plan: TransferPlan, links: dict[int, dict[int, Mailbox]], all_links: list[Mailbox],
            group: dict[str, Any], relay: RelayHub | None, streams: dict[int, RelayStream], topo: Topology,
            port: int, token: bytes) -> tuple[dict[tuple[int, int], dict[str, Any]], list[str]]:
    """Every (destination rank, source rank)'s transport group and epoch, from the trainer's `ws.epoch`.

    With fanOut Relay the frame may chain this replica (agent/transfer/relay.py): `relay_to` registers the source's
    buckets to be forwarded (`streams`); `relay_from` replaces the trainer's link by one to the upstream
    replica's agent, whose own `ws.epoch` then names the hop's group. Every relay link is opened before any is
    waited on: the upstream starts a hop only once all destination ranks of the source joined it. Returns the
    groups and the upstream pods this version is relayed from."""
    pods = {p.name: p.ip or "" for rep in topo.inference for p in rep.pods}
    out: dict[tuple[int, int], dict[str, Any]] = {}
    upstream_pods: list[str] = []
    upstream: dict[tuple[int, int], dict[str, Any]] = {}
    for r in list(links):
        for s, mb in list(links[r].items()):
            h, _ = mb.get(P.EPOCH, timeout=EPOCH_TIMEOUT)
            if relay is not None and h.get("relay_to") is not None and s not in streams:
                to_group, to_pod, _ = parse_hop(h["relay_to"], pods)
                streams[s] = relay.expect(version, s, plan, to_group, to_pod)
            if h.get("relay_from") is None:
                out[(r, s)] = {**group, "epoch": str(h.get("epoch"))}
                continue
            if relay is None:
                raise ValueError(f"trainer rank {s} chained this replica behind another, which it did not offer")
            from_group, from_pod, ip = parse_hop(h["relay_from"], pods)
            mb.close()
            link = connect(ip, port, token, timeout=10.0)
            link.send({"kind": P.RELAY, "version": version, "src": s, "dst": r, "plan_hash": plan.hash})
            relayed = Mailbox(link, name=f"relay{s}@{from_pod}->dst{r}")
            links[r][s] = relayed
            all_links.append(relayed)
            upstream[(r, s)] = from_group
            if from_pod not in upstream_pods:
                upstream_pods.append(from_pod)
    for (r, s), from_group in upstream.items():
        h, _ = links[r][s].get(P.EPOCH, timeout=RELAY_JOIN_S + 10.0)
        out[(r, s)] = {**from_group, "epoch": str(h.get("epoch"))}
    return out, upstream_pods


def fetch_version(
    version: int,
    *,
    peers: TrainerPeers,
    topo: Topology,
    replica: int,
    my_ranks: list[int],
    adapter: EngineAdapter,
    transport_for: TransportFor,
    group: dict[str, Any],
    proposal: str,
    bucket_bytes: int,
    pause_generation: bool,
    port: int,
    token: bytes,
    layout_fn: Callable[[dict[str, TensorShard], int, int], list[list[TensorShard]]] | None = None,
    expand_aliases: bool = True,
    verify: bool = False,
    device: str = "cpu",
    timeout: float = 600.0,
    progress: Callable[[int, int, int, int], None] | None = None,
    relay: RelayHub | None = None,
    pod: str = "",
) -> FetchResult:
    """Fetch `version` for this agent's ranks of `replica` and load it into the engine; raises FetchError.
    `progress(buckets_done, buckets, bytes_done, bytes_total)` is called after every bucket (any thread).
    `relay` (spec.transfer.fanOut Relay): this agent may be chained with other replicas fetching the same
    version (agent/transfer/relay.py); None: the trainer agents send to it directly."""
    t0 = time.perf_counter()
    rep = next((r for r in topo.inference if r.replica == replica), None)
    if rep is None:
        raise FetchError(f"replica {replica} is not in the topology")
    src_meta, aliases = peers.meta(version)
    world_src = topo.trainer.world_size
    missing = [r for r in range(world_src) if r not in src_meta]
    if missing:
        raise FetchError(f"trainer ranks {missing} have not published version {version}")
    # IPC moves bytes through the shared memory of this pod's group only: replicas of a shard held by
    # trainer ranks elsewhere (data parallel across pods) must not be chosen as the source (`reachable`).
    # Tables, inputs and key are memoized: a version with the same layout finds its plan by lookups.
    sources = P.sources_table(src_meta, world_src, reachable_sources(topo, str(group.get("name", ""))))

    def layout() -> list[list[TensorShard]] | ShardTable:
        if layout_fn is None and rep.world_size == rep.tensor:
            try:
                return P.tp_needs_table(sources, rep.tensor)  # the default rules, as arrays
            except LayoutError as exc:
                raise FetchError(f"cannot lay out the model for TP {rep.tensor}: {exc}") from None
        return compute_needs(dict(sources.full_shards), rep.world_size, rep.tensor, layout_fn)

    needs = P.needs_table(sources, rep.world_size, rep.tensor, layout_fn, layout)
    inputs = P.plan_inputs(sources, needs, bucket_bytes)
    plan = PLANS.get_or_build(inputs, inputs.build)  # once per layout
    sessions = peers.trainer_sessions()
    host_of: dict[int, str] = {}
    for m in topo.trainer.pods:
        for r in m.ranks:
            host_of[r] = m.ip or ""
    receive_allocator = getattr(adapter, "receive_allocator", None)
    if not isinstance(receive_allocator, SharedSlotAllocator):
        receive_allocator = None  # only an adapter that hands shared segments to its engine has one
    links: dict[int, dict[int, Mailbox]] = {r: {} for r in my_ranks}
    all_links: list[Mailbox] = []
    digest = Digest()  # one for the agent's destination ranks: a region two of them hold counts once
    checks = {r: ChecksumHooks() if verify else None for r in my_ranks}
    hooks = {r: DigestHooks(inner=checks[r], digest=digest) for r in my_ranks}
    receivers: dict[int, WeightReceiver] = {}
    streams: dict[int, RelayStream] = {}  # the sources this agent forwards to the next replica (relay_to)
    hand_pieces = loads_pieces(adapter)
    try:
        for r in my_ranks:
            for s in plan.srcs_of(r):
                if not host_of.get(s):
                    raise FetchError(f"trainer rank {s} has no pod IP yet")
                link = connect(host_of[s], port, token, timeout=10.0)
                P.send_transfer(link, {"kind": P.TRANSFER, "version": version, "src": s, "dst": r, "replica": replica,
                                       "group": group, "plan_hash": plan.hash, "proposal": proposal, "pod": pod,
                                       "relay": relay is not None}, inputs,
                                with_inputs=P.SENT_INPUTS.due(host_of[s], sessions, inputs.key))
                mb = Mailbox(link, name=f"src{s}->dst{r}")
                links[r][s] = mb
                all_links.append(mb)
        groups, relayed_from = _epochs(version, plan, links, all_links, group, relay, streams, topo, port, token)
        for r in my_ranks:
            by_src: dict[int, Transport] = {}
            for s in links[r]:
                t, _ = transport_for(groups[(r, s)], plan, f"dst{r}<-src{s}")
                if receive_allocator is not None:
                    # a transport that cannot receive into the shared slots (GDR with delta sync) takes its
                    # own receive buffers from the same allocator, so the engine still loads in place
                    t.use_allocator(receive_allocator)
                by_src[s] = t
            transport = RoutingTransport(by_src, receive_slots(r, receive_allocator))
            check = checks[r]
            if check is not None and transport.can_refetch:
                check.refetch = transport.refetch  # a checksum mismatch reads the bucket again before failing
            receivers[r] = WeightReceiver(plan, r, transport, links[r], timeout=timeout, device=device,
                                          hooks=hooks[r], hand_pieces=hand_pieces,
                                          tap=RelayTap(streams, r) if streams else None)
    except (LinkError, OSError, ValueError) as exc:
        P.SENT_INPUTS.forget(inputs.key)  # a trainer agent may lack them (restarted, evicted): send them again
        for st in streams.values():
            st.detach(f"this replica could not start version {version}: {exc}")
        for mb in all_links:
            mb.close()
        raise FetchError(f"connecting to the trainer agents for version {version}: {exc}") from None
    except BaseException:
        P.SENT_INPUTS.forget(inputs.key)
        for st in streams.values():
            st.detach(f"this replica could not start version {version}")
        for mb in all_links:
            mb.close()
        raise

    pipe = _BucketPipe(len(receivers))
    results: list[SyncStats] = []
    total_buckets = sum(len(rc.buckets) for rc in receivers.values())
    total_bytes = sum(b.nbytes for rc in receivers.values() for b in rc.buckets)
    done = [0, 0]
    done_lock = threading.Lock()

    def on_progress(nbytes: int) -> None:
        with done_lock:
            done[0] += 1
            done[1] += nbytes
            now = (done[0], done[1])
        if progress is not None:
            progress(now[0], total_buckets, now[1], total_bytes)
    alias_of: dict[str, list[str]] = {}
    for alias, target in aliases.items():
        alias_of.setdefault(target, []).append(alias)

    def run(r: int, receiver: WeightReceiver) -> None:
        def on_bucket(tensors: NamedTensors) -> None:
            if expand_aliases and alias_of:
                tensors = with_aliases(tensors, alias_of)
            pipe.push(tensors, r)

        try:
            results.append(receiver.receive_version(on_bucket, expected_version=version, on_progress=on_progress))
            pipe.finish()
        except BaseException as exc:
            pipe.finish(exc)

    threads = [threading.Thread(target=run, args=(r, rc), name=f"receive-v{version}-dst{r}", daemon=True)
               for r, rc in receivers.items()]
    for th in threads:
        th.start()
    try:
        load_version(RankRouter(adapter, lambda: None if digest.unchecked else digest.hex()), version, pipe,
                     pause_generation=pause_generation)
    except Exception as exc:
        pipe.cancel()
        raise FetchError(f"version {version} was not committed: {exc}") from exc
    finally:
        for th in threads:
            th.join(timeout)
        for mb in all_links:
            mb.close()
    nbytes = sum(st.bytes for st in results)
    verified = sum(c.stats.bytes for c in checks.values() if c is not None)
    return FetchResult(version, nbytes, time.perf_counter() - t0, results, verified_bytes=verified,
                       digest=digest.hex(), digest_checked=not digest.unchecked,
                       digest_bytes=sum(h.stats.bytes for h in hooks.values()),
                       digest_reused_bytes=sum(h.stats.reused_bytes for h in hooks.values()),
                       relayed_from=relayed_from)
