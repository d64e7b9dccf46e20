"""The relay data path (agent/transfer/relay.py) with real parts in one process: a trainer's WeightSender, an upstream
replica's receivers lending their buckets (RelayTap), the RelayServer's authenticated listener, and a
downstream replica receiving over its own gloo groups, each endpoint in a thread of its own.

What must hold: the downstream gets the trainer's bytes, checked against the trainer's leaves; and nothing
the downstream does (never joining, stalling, receiving corrupted bytes) fails or stalls the upstream's
own load beyond the relay's deadlines."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from wsagent_helpers import full_tensor, same_bits, slice_of

from weightsync.agent.layout.rules import TensorMeta, inference_layout, trainer_layout
from weightsync.agent.plan import BucketPlan, TransferPlan, build_plan
from weightsync.agent.transfer.digest import Digest, DigestHooks, DigestMismatch
from weightsync.agent.transfer.receive import WeightReceiver
from weightsync.agent.transfer.relay import (
    RelayHub,
    RelayServer,
    RelayStream,
    RelayTap,
    chain_links,
    parse_hop,
)
from weightsync.agent.transfer.send import WeightSender
from weightsync.agent.transfer.sync import SyncError
from weightsync.agent.transports.nccl import NcclTransport, make_store
from weightsync.agent.wire import protocol as P
from weightsync.agent.wire.link import LinkListener, Mailbox, connect

TOKEN = "relay-test-token-0123456789abcdef"
HOST = "127.0.0.1"
TP = 2  # each replica: two destination ranks in one agent (norm weights go to both: broadcast buckets)


def _metas() -> list[TensorMeta]:
    out = [TensorMeta("model.embed_tokens.weight", "bfloat16", (96, 32))]
    for i in range(2):
        p = f"model.layers.{i}"
        out += [TensorMeta(f"{p}.input_layernorm.weight", "float32", (32,)),
                TensorMeta(f"{p}.self_attn.q_proj.weight", "bfloat16", (32, 32)),
                TensorMeta(f"{p}.mlp.down_proj.weight", "bfloat16", (32, 64))]
    return out


def _plan() -> TransferPlan:
    metas = _metas()
    sources = [trainer_layout(metas, tp_size=1, tp_rank=0)]
    needs = [inference_layout(metas, TP, r) for r in range(TP)]
    return build_plan(sources, needs, 4096)


class Chain:
    """trainer (src 0) -> replica A (dst 0, 1; relays) -> replica D (dst 0, 1)."""

    def __init__(self, *, join_s: float = 10.0, lag_s: float = 10.0) -> None:
        self.plan = _plan()
        self.store = make_store(HOST, 0, is_master=True, timeout=30)
        self.tensors = {s.name: slice_of(full_tensor(s.name, s.dtype, s.global_shape, 1), s.box).contiguous()
                        for s in self.plan.sources[0]}
        self.hub = RelayHub(lambda g, p, role: (self._transport(f"hop-{g['epoch']}"), None), timeout=30,
                            join_s=join_s, lag_s=lag_s)
        self.server = RelayServer(HOST, 0, TOKEN, self.hub).start()
        self.results: dict[str, Any] = {}
        self.digests = {"A": Digest(), "D": Digest()}
        self.threads: list[threading.Thread] = []

    def _transport(self, prefix: str) -> NcclTransport:
        # a store client per endpoint, as each agent has its own: one client's blocking wait holds its socket
        client = make_store(HOST, self.store.port, is_master=False, timeout=30)
        return NcclTransport(dist.PrefixStore(prefix + "/", client), host=HOST, timeout=20)

    def _run(self, name: str, fn: Callable[[], Any]) -> None:
        def body() -> None:
            try:
                self.results[name] = fn()
            except BaseException as exc:
                self.results[name] = exc
        th = threading.Thread(target=body, name=name, daemon=True)
        th.start()
        self.threads.append(th)

    def _receive(self, who: str, r: int, mb: Mailbox, prefix: str, tap: RelayTap | None) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        rx = WeightReceiver(self.plan, r, self._transport(prefix), {0: mb}, timeout=20,
                            hooks=DigestHooks(digest=self.digests[who]), tap=tap)

        def on_bucket(items: Any) -> None:
            time.sleep(0.01)  # the engine's load: the forward overlaps it
            for n, t in items:
                got[n] = t.clone()
        rx.receive_version(on_bucket, expected_version=1)
        return got

    def start_trainer_and_upstream(self, tap: type[RelayTap] = RelayTap) -> dict[int, RelayStream]:
        listener = LinkListener(HOST, 0, TOKEN)
        streams = {0: self.hub.expect(1, 0, self.plan, {"epoch": "e1"}, "replica-d")}
        ups = {}
        for r in range(TP):
            ups[r] = Mailbox(connect(HOST, listener.port, TOKEN))
            ups[r].send("hello", dst=r)
        downs = {}
        for _ in range(TP):
            mb = Mailbox(listener.accept(timeout=10))
            downs[int(mb.get("hello", timeout=10)[0]["dst"])] = mb

        def trainer() -> Any:
            sender = WeightSender(self.plan, 0, self._transport("trainer"), downs, timeout=20, hooks=DigestHooks())
            return sender.send_version(1, self.tensors)
        self._run("trainer", trainer)
        for r in range(TP):
            def upstream(r: int = r) -> Any:
                return self._receive("A", r, ups[r], "trainer", tap(streams, r))
            self._run(f"A{r}", upstream)
        return streams

    def join_downstream(self, *, receive: bool = True) -> None:
        mbs = {}
        for r in range(TP):
            link = connect(HOST, self.server.port, TOKEN)
            link.send({"kind": P.RELAY, "version": 1, "src": 0, "dst": r, "plan_hash": self.plan.hash})
            mbs[r] = Mailbox(link)
        if not receive:
            self.stalled = mbs  # joined, then never takes a bucket
            return
        for r in range(TP):
            def down(r: int = r) -> Any:
                mbs[r].get(P.EPOCH, timeout=20)
                return self._receive("D", r, mbs[r], "hop-e1", None)
            self._run(f"D{r}", down)

    def wait(self, timeout: float = 60.0) -> dict[str, Any]:
        for th in self.threads:
            th.join(timeout)
            assert not th.is_alive(), f"{th.name} still running after {timeout}s"
        return self.results

    def expected(self, r: int) -> dict[str, torch.Tensor]:
        return {s.name: slice_of(full_tensor(s.name, s.dtype, s.global_shape, 1), s.box) for s in self.plan.needs[r]}

    def assert_served(self, who: str) -> None:
        for r in range(TP):
            got = self.results[f"{who}{r}"]
            assert isinstance(got, dict), f"{who}{r} failed: {got!r}"
            want = self.expected(r)
            assert set(got) == set(want)
            assert all(same_bits(got[n], want[n]) for n in want), f"{who}{r} is not bit-exact"

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def chains() -> Any:
    made: list[Chain] = []
    yield made
    for c in made:
        c.close()


def test_downstream_gets_the_trainers_bytes_checked_against_the_trainers_leaves(chains: list[Chain]) -> None:
    c = Chain()
    chains.append(c)
    streams = c.start_trainer_and_upstream()
    c.join_downstream()
    c.wait()
    c.assert_served("A")
    c.assert_served("D")
    assert not isinstance(c.results["trainer"], BaseException), c.results["trainer"]
    assert streams[0].detached is None
    # every bucket the source sends went through the relay once, whichever rank(s) of A received it
    assert streams[0].forwarded_bytes == sum(b.nbytes for b in c.plan.buckets_from(0))
    assert any(len(b.dsts) > 1 for b in c.plan.buckets_from(0)), "the plan should have broadcast buckets"
    # the downstream checked every piece against the trainer's leaves, and both replicas name the same bytes
    assert not c.digests["D"].unchecked and c.digests["D"].hex() == c.digests["A"].hex()


def test_a_downstream_that_never_joins_is_detached_and_the_upstream_loads(chains: list[Chain]) -> None:
    c = Chain(join_s=1.0)
    chains.append(c)
    t0 = time.monotonic()
    streams = c.start_trainer_and_upstream()
    c.wait()
    c.assert_served("A")
    assert "did not join within 1s" in (streams[0].detached or "")
    assert time.monotonic() - t0 < 15


def test_a_downstream_that_stalls_is_detached_within_the_lag_deadline(chains: list[Chain]) -> None:
    c = Chain(lag_s=1.5)
    chains.append(c)
    streams = c.start_trainer_and_upstream()
    c.join_downstream(receive=False)
    c.wait()
    c.assert_served("A")
    assert streams[0].detached is not None and "1.5s" in streams[0].detached
    # the stalled downstream is told why (its fetch fails, and its next attempt asks the trainer directly)
    with pytest.raises(Exception, match="relay detached this replica"):
        c.stalled[0].get("sync.go", timeout=5)  # never sent: only the relay's abort ends this wait


class _CorruptingTap(RelayTap):
    """The upstream's memory changes after its check (a hostile engine writing its receive slot)."""

    def offer(self, bucket: BucketPlan, data: torch.Tensor, meta: dict[str, Any] | None) -> None:
        bad = data.clone()
        bad[0] ^= 0xFF
        super().offer(bucket, bad, meta)


def test_bytes_changed_on_the_relay_are_refused_downstream_and_the_upstream_loads(chains: list[Chain]) -> None:
    c = Chain()
    chains.append(c)
    streams = c.start_trainer_and_upstream(tap=_CorruptingTap)
    c.join_downstream()
    c.wait()
    c.assert_served("A")
    errors = [c.results[f"D{r}"] for r in range(TP)]
    assert all(isinstance(e, SyncError) for e in errors), errors
    assert any(isinstance(e.__cause__, DigestMismatch) or "digest" in str(e) for e in errors), errors
    assert streams[0].detached is not None


def test_chain_links_and_hops_are_checked() -> None:
    members = [({"name": f"replica-{i}", "generation": 3, "store": ["10.0.0.1", 47102]}, f"pod-{i}", [f"p{i}"])
               for i in range(3)]
    links = chain_links(members, lambda props: "+".join(props))
    assert links[0][0] is None and links[2][1] is None
    assert links[0][1] is not None and links[1][0] is not None
    assert links[0][1]["group"] == links[1][0]["group"]  # one hop, one group
    assert links[0][1]["group"]["name"] == "relay-replica-0-replica-1" and links[0][1]["group"]["epoch"] == "p0+p1"
    assert links[1][0]["pod"] == "pod-0" and links[0][1]["pod"] == "pod-1"
    pods = {"pod-0": "10.0.0.5", "pod-1": "10.0.0.6", "pod-2": ""}
    assert parse_hop(links[1][0], pods)[1:] == ("pod-0", "10.0.0.5")
    for bad, why in (({"pod": "elsewhere", "group": {}}, "not an inference pod"),
                     ({"pod": "pod-1", "group": {"name": "x"}}, "malformed group"),
                     ({**links[1][1], "pod": "pod-2"}, "no IP yet"),
                     ("pod-1", "must be an object")):
        with pytest.raises(ValueError, match=why):
            parse_hop(bad, pods)


def test_the_relay_port_refuses_wrong_ranks_floods_and_strangers(chains: list[Chain], monkeypatch: Any) -> None:
    """Hostile input on an inference agent's control port: a link without the job token is refused at the
    handshake; a frame that is not ws.relay gets an error; a rank the plan lacks is refused by name; and pending
    relays are bounded (each waits at most join_s)."""
    import weightsync.agent.transfer.relay as relay_mod
    from weightsync.agent.wire.link import LinkError

    c = Chain(join_s=30.0)
    chains.append(c)
    c.hub.expect(1, 0, c.plan, {"epoch": "e1"}, "replica-d")
    with pytest.raises((LinkError, OSError)):
        connect(HOST, c.server.port, "not-the-job-token").recv(timeout=5)
    link = connect(HOST, c.server.port, TOKEN)
    link.send({"kind": P.TRANSFER, "version": 1})
    h, _ = link.recv(timeout=5)
    assert h["kind"] == P.ERROR and P.RELAY in h["message"]
    wrong = connect(HOST, c.server.port, TOKEN)
    wrong.send({"kind": P.RELAY, "version": 1, "src": 0, "dst": 7, "plan_hash": c.plan.hash})
    with pytest.raises(Exception, match="destination rank 7 receives nothing"):
        Mailbox(wrong).get(P.EPOCH, timeout=5)
    monkeypatch.setattr(relay_mod, "MAX_PENDING_RELAYS", 3)
    kept = []
    for v in range(2, 5):  # two more keys fill the bound (the expectation above is one)
        kept.append(connect(HOST, c.server.port, TOKEN))
        kept[-1].send({"kind": P.RELAY, "version": v, "src": 0, "dst": 0, "plan_hash": "x"})
        if v < 4:  # each link has its own handler thread: wait for this key before the next, so the refused one is v4
            deadline = time.monotonic() + 10
            while len(c.hub._relays) < v and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(c.hub._relays) == v
    over = Mailbox(kept[-1])
    with pytest.raises(LinkError, match="already has 3 relays pending"):
        over.get(P.EPOCH, timeout=5)


def test_an_agent_keeps_the_transports_of_its_recent_relay_hops_only() -> None:
    """Churn: each hop a replica was ever in is a group `relay-<up>-<down>`; the cache keeps the hops this agent
    used last (KEEP_RELAY_GROUPS, by last use, every role), closes the older ones once they were idle for the
    transfer timeout, and leaves the replicas' own groups alone however many hops come and go."""
    from weightsync.agent.transfer.groups import KEEP_RELAY_GROUPS, TransportCache, proposal_of

    busy = TransportCache(mode="IPC", job="j", pod_ip="127.0.0.1", transport_port=0, timeout=600.0)
    for i in range(KEEP_RELAY_GROUPS + 3):  # every hop used within the transfer timeout: none is closed under it
        busy.get({"name": f"relay-a-{i}", "generation": 1, "epoch": "e"}, None, role="dst")
    assert len(busy._order) == KEEP_RELAY_GROUPS + 3 and busy.relay_evictions == 0
    busy.close()
    cache = TransportCache(mode="IPC", job="j", pod_ip="127.0.0.1", transport_port=0, timeout=0.0)

    def get(name: str, role: str = "dst") -> Any:
        return cache.get({"name": name, "generation": 1, "epoch": "e"}, None, role=role)[0]

    own = get("replica-0")
    closed: list[str] = []
    hops = {}
    for i in range(KEEP_RELAY_GROUPS + 3):
        name = f"relay-replica-{i}-replica-{i + 1}"
        t = hops[name] = get(name, "src" if i % 2 else "dst")
        t.close = lambda name=name: closed.append(name)
        if i == 1:
            assert get("relay-replica-0-replica-1") is hops["relay-replica-0-replica-1"]  # used again: kept longer
    kept = {k[0] for k in cache._order}
    assert "replica-0" in kept and get("replica-0") is own
    relays = sorted(n for n in kept if n.startswith("relay-"))
    assert len(relays) == KEEP_RELAY_GROUPS
    assert closed == ["relay-replica-1-replica-2", "relay-replica-0-replica-1", "relay-replica-2-replica-3"]
    assert set(relays) | set(closed) == set(hops)
    # the far end of a closed hop may still hold its own: this agent's next proposal differs, so no later
    # chain can pair that stale end with a fresh one under the same epoch
    assert cache.relay_evictions == 3
    assert proposal_of("s", 0, ["t"], cache.relay_evictions) != proposal_of("s", 0, ["t"])
    assert proposal_of("s", 0, ["t"], 0) == proposal_of("s", 0, ["t"])  # unchanged for agents that closed none
    cache.close()
