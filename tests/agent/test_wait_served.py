"""wait_served in one process: the trainer agent's ServedTracker rules, the ws.served reports over real
authenticated links (TrainerPeers -> WeightServer), and the client's TrainerSession.wait_served/served
against a stand-in agent on a real Unix socket."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from weightsync.agent.client import ServedState, ServedTimeout, TrainerSession
from weightsync.agent.metrics import AgentMetrics
from weightsync.agent.staging.versions import StagedVersions
from weightsync.agent.transfer.fetch import TrainerPeers
from weightsync.agent.transfer.serve import WeightServer
from weightsync.agent.transfer.served import ServedTracker, loading_pods
from weightsync.agent.wire import protocol as P
from weightsync.agent.wire.link import connect
from weightsync.agent.wire.local import LocalServer
from weightsync.crds.topology import InferenceReplicaTopology, PodMember, Topology, TrainerTopology

TOKEN = b"wait-served-token"


def topo(replicas: dict[int, list[list[int]]], trainer_ip: str = "127.0.0.1") -> Topology:
    """replicas: replica -> the ranks of each of its pods (pod names j-inference-<replica>-<index>)."""
    inference = [InferenceReplicaTopology(replica=r, tensor=sum(len(x) for x in pods),
                                          world_size=sum(len(x) for x in pods),
                                          pods=[PodMember(name=f"j-inference-{r}-{i}", index=i, ranks=ranks)
                                                for i, ranks in enumerate(pods)])
                 for r, pods in replicas.items()]
    return Topology(job="j", namespace="default", generation=1, placement="Separated", mode="NCCL", bucket_size_mb=1,
                    trainer=TrainerTopology(world_size=1, tensor=1, pipeline=1, data=1, pods=[
                        PodMember(name="j-trainer-0", index=0, ranks=[0], ip=trainer_ip)]),
                    inference=inference)


def wait_until(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# --- the trainer agent's rules ---------------------------------------------------------------------------
def test_loading_pods_full_tensor_engines_load_on_the_rank0_pod_only() -> None:
    t = topo({0: [[0, 1], [2, 3]]})
    assert loading_pods(t.inference[0], full_tensors=False) == ["j-inference-0-0", "j-inference-0-1"]
    assert loading_pods(t.inference[0], full_tensors=True) == ["j-inference-0-0"]


def test_replica_serves_the_lowest_version_of_its_loading_pods() -> None:
    t = topo({0: [[0], [1]], 1: [[0]]})
    tr = ServedTracker()
    for key, pod in enumerate(["j-inference-0-0", "j-inference-0-1", "j-inference-1-0"]):
        tr.link_opened(pod, key)
    state = tr.fleet(t, full_tensors=False)
    assert state.replicas == {0: None, 1: None} and state.version is None and not state.reaches(1)
    tr.report("j-inference-0-0", 0, 5)
    tr.report("j-inference-1-0", 2, 5)
    state = tr.fleet(t, full_tensors=False)
    assert state.replicas == {0: None, 1: 5}, "one pod of replica 0 has not committed anything"
    assert tr.fleet(t, full_tensors=True).replicas == {0: 5, 1: 5}, "SGLang/vLLM: the rank-0 pod loads for all"
    tr.report("j-inference-0-1", 1, 4)
    state = tr.fleet(t, full_tensors=False)
    assert state.replicas == {0: 4, 1: 5} and state.version == 4
    assert state.reaches(4) and not state.reaches(5)
    assert state.to_dict() == {"served_version": 4, "replicas": [
        {"replica": 0, "served": 4, "pods": {"j-inference-0-0": 5, "j-inference-0-1": 4}},
        {"replica": 1, "served": 5, "pods": {"j-inference-1-0": 5}}]}
    # a pod outside the topology (scaled down, or never a member) does not count
    tr.link_opened("someone-else", 9)
    tr.report("someone-else", 9, 1)
    assert tr.fleet(t, full_tensors=False).version == 4
    assert ServedTracker().fleet(topo({}), full_tensors=False).reaches(10), "no replica: nothing to wait for"


def test_reports_are_bound_to_their_link() -> None:
    t = topo({0: [[0]]})
    tr = ServedTracker()
    tr.report("j-inference-0-0", 1, 3)
    assert tr.fleet(t, False).replicas == {0: None}, "a report on a link without a hello does not count"
    tr.link_opened("j-inference-0-0", 1)
    tr.report("j-inference-0-0", 1, 3)
    assert tr.fleet(t, False).replicas == {0: 3}
    tr.link_opened("j-inference-0-0", 2)  # the agent restarted (or reconnected): it reports again
    assert tr.fleet(t, False).replicas == {0: None}
    tr.report("j-inference-0-0", 1, 7)  # a late frame of the replaced link
    assert tr.fleet(t, False).replicas == {0: None}
    tr.report("j-inference-0-0", 2, 4)
    tr.link_closed("j-inference-0-0", 1)  # the old link's close does not drop the new link's report
    assert tr.fleet(t, False).replicas == {0: 4}
    tr.link_closed("j-inference-0-0", 2)
    assert tr.fleet(t, False).replicas == {0: None}


def test_wait_wakes_on_a_report_and_times_out_with_the_state() -> None:
    t = topo({0: [[0]], 1: [[0]]})
    tr = ServedTracker()
    tr.link_opened("j-inference-0-0", 0)
    tr.link_opened("j-inference-1-0", 1)
    tr.report("j-inference-0-0", 0, 2)
    t0 = time.monotonic()
    reached, state = tr.wait(2, 0.3, lambda: t, False)
    assert not reached and state.replicas == {0: 2, 1: None} and 0.25 < time.monotonic() - t0 < 2

    threading.Timer(0.2, tr.report, args=("j-inference-1-0", 1, 3)).start()
    t0 = time.monotonic()
    reached, state = tr.wait(2, 30, lambda: t, False)
    assert reached and state.replicas == {0: 2, 1: 3} and time.monotonic() - t0 < 5
    reached, _ = tr.wait(5, 30, lambda: t, False, cancelled=lambda: True)
    assert not reached


def test_only_serving_leaves_out_replicas_that_serve_nothing_but_needs_one() -> None:
    """An RL loop goes on while a replica's pod is replaced: wait_served(only_serving=True)."""
    t = topo({0: [[0]], 1: [[0]]})
    tr = ServedTracker()
    tr.link_opened("j-inference-0-0", 0)
    tr.link_opened("j-inference-1-0", 1)
    assert not tr.fleet(t, False).reaches(1, only_serving=True), "nothing served anywhere: not reached"
    tr.report("j-inference-0-0", 0, 4)
    tr.report("j-inference-1-0", 1, 3)
    state = tr.fleet(t, False)
    assert state.reaches(3, only_serving=True) and not state.reaches(4, only_serving=True), \
        "a replica that serves an older version is still waited for"
    tr.link_closed("j-inference-1-0", 1)  # its pod was deleted
    state = tr.fleet(t, False)
    assert not state.reaches(4) and state.reaches(4, only_serving=True)
    reached, _ = tr.wait(4, 5, lambda: t, False, only_serving=True)
    assert reached
    tr.link_opened("j-inference-1-0", 2)  # the new pod's agent: connected, nothing committed yet
    assert tr.fleet(t, False).reaches(4, only_serving=True)
    tr.report("j-inference-1-0", 2, 2)  # it loaded an old version: waited for again
    assert not tr.fleet(t, False).reaches(4, only_serving=True)


# --- ws.served over real links ------------------------------------------------------------------------------
@pytest.fixture
def server(tmp_path: Path) -> Any:
    store = StagedVersions([0], f"wstest-served-{id(tmp_path)}")
    srv = WeightServer(host="127.0.0.1", port=0, token=TOKEN, pod="j-trainer-0", store=store,
                       transport_for=lambda *a: (_ for _ in ()).throw(AssertionError("no transfer here")),
                       metrics=AgentMetrics(), mode="NCCL", generation=lambda: 1).start()
    yield srv
    srv.close()
    store.close()


def test_inference_agent_reports_commits_and_reports_again_after_a_reconnect(server: WeightServer) -> None:
    t = topo({0: [[0]]})
    peers = TrainerPeers(t, port=server.port, token=TOKEN, pod="j-inference-0-0", replica=0, on_announce=lambda: None)
    try:
        wait_until(peers.connected)
        assert server.served.fleet(t, False).replicas == {0: None}
        peers.report_served(3)
        wait_until(lambda: server.served.fleet(t, False).replicas == {0: 3})
        peers.report_served(4)
        wait_until(lambda: server.served.fleet(t, False).replicas == {0: 4})
        # the control link drops: the trainer forgets, the inference agent reconnects and reports again
        peer = next(iter(peers._peers.values()))
        old = peer.link
        assert old is not None
        old.close()
        # the new link exists once the trainer welcomed it, i.e. after it dropped the old link's report:
        # from then on only the report sent again on the new link can make replica 0 serve 4
        wait_until(lambda: peer.link is not None and peer.link is not old)
        wait_until(lambda: server.served.fleet(t, False).replicas == {0: 4})
    finally:
        peers.close()
    wait_until(lambda: server.served.fleet(t, False).replicas == {0: None})


def test_a_zero_report_withdraws_the_replica(server: WeightServer) -> None:
    """An engine left with no complete version (failed load, failed restore) no longer counts as serving."""
    link = connect("127.0.0.1", server.port, TOKEN)
    try:
        link.send({"kind": P.HELLO, "pod": "j-inference-0-0", "replica": 0, "session": "x"})
        assert link.recv(timeout=10)[0]["kind"] == P.WELCOME
        t = topo({0: [[0]]})
        link.send({"kind": P.SERVED, "version": 5})
        wait_until(lambda: server.served.fleet(t, False).replicas == {0: 5})
        link.send({"kind": P.SERVED, "version": 0})
        wait_until(lambda: server.served.fleet(t, False).replicas == {0: None})
    finally:
        link.close()


def test_a_bad_served_report_is_refused(server: WeightServer) -> None:
    link = connect("127.0.0.1", server.port, TOKEN)
    try:
        link.send({"kind": P.HELLO, "pod": "j-inference-0-0", "replica": 0, "session": "x"})
        assert link.recv(timeout=10)[0]["kind"] == P.WELCOME
        link.send({"kind": P.SERVED, "version": "7"})
        h, _ = link.recv(timeout=10)
        assert h["kind"] == P.ERROR and "version" in h["message"]
        link.send({"kind": P.SERVED, "version": -1})
        h, _ = link.recv(timeout=10)
        assert h["kind"] == P.ERROR and ">= 1" in h["message"]
        assert server.served.fleet(topo({0: [[0]]}), False).replicas == {0: None}
    finally:
        link.close()


# --- the client --------------------------------------------------------------------------------------------
def fake_agent(path: Path, answer: Any) -> tuple[LocalServer, list[dict[str, Any]]]:
    """A trainer agent stand-in on a real Unix socket: hello, then `answer(request)` for every request."""
    seen: list[dict[str, Any]] = []

    def handler(conn: Any) -> None:
        conn.recv()
        conn.reply_ok(pod="j-trainer-0", role="trainer", job="j")
        while True:
            h, _ = conn.recv()
            seen.append(h)
            conn.reply_ok(**answer(h))

    return LocalServer(path, handler).start(), seen


def test_client_wait_served_returns_state_or_raises_a_clear_timeout(tmp_path: Path) -> None:
    state = ServedState({0: 7, 1: 5, 2: None}, {0: {"j-inference-0-0": 7}, 1: {"j-inference-1-0": 5},
                                                2: {"j-inference-2-0": None, "j-inference-2-1": 6}})
    reply = {"replicas": [{"replica": r, "served": v, "pods": state.pods[r]} for r, v in state.replicas.items()]}

    def answer(h: dict[str, Any]) -> dict[str, Any]:
        return {**reply, "version": h.get("version", 0), "reached": h.get("version", 0) <= 5}

    srv, seen = fake_agent(tmp_path / "agent.sock", answer)
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=0) as s:
            assert s.served() == state and s.served().version is None
            with pytest.raises(ServedTimeout) as err:
                s.wait_served(6, timeout=2.5)
            assert err.value.version == 6 and err.value.timeout == 2.5 and err.value.state == state
            assert isinstance(err.value, TimeoutError)
            msg = str(err.value)
            assert msg.startswith("version 6 is not served by every inference replica after 2.5s: 2 of 3 replicas")
            assert "replica 1 serves 5 (pod j-inference-1-0: 5)" in msg
            assert "replica 2 serves nothing yet (pod j-inference-2-0: none, pod j-inference-2-1: 6)" in msg
            assert "replica 0" not in msg, "replicas that serve the version are not listed"
            assert s.wait_served(5, timeout=1) == state
            assert seen[-1] == {"op": "wait_served", "version": 5, "timeout": 1.0}
            assert s.wait_served(5, timeout=1, only_serving=True) == state
            assert seen[-1] == {"op": "wait_served", "version": 5, "timeout": 1.0, "only_serving": True}
            with pytest.raises(ServedTimeout, match="not served by every inference replica that serves something"):
                s.wait_served(6, timeout=1, only_serving=True)
            n = len(seen)
            s.wait_served(0, timeout=1)  # step - maxStaleness < 1 in the first steps: no wait
            assert seen[n:] == [{"op": "served"}]
            with pytest.raises(ValueError, match="timeout"):
                s.wait_served(3, timeout=-1)
            with pytest.raises(ValueError, match="timeout"):
                s.wait_served(3, timeout=float("nan"))
    finally:
        srv.close()
