"""The control port faces the network: bad peers are rejected and logged, and the agent keeps serving."""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path

import pytest
from podprocs import Cluster, engine_version, get_json, get_text, metric_value, wait_for

from weightsync.agent.wire import protocol as P
from weightsync.agent.wire.link import AuthError, LinkError, connect
from weightsync.crds import contract


def _raw(ip: str, data: bytes, *, read: bool = True) -> bytes:
    with socket.create_connection((ip, contract.CONTROL_PORT), timeout=5) as s:
        got = s.recv(64) if read else b""
        s.sendall(data)
        time.sleep(0.1)
        return got


def test_bad_peers_are_rejected_and_the_agent_keeps_serving(tmp_path: Path, clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="NCCL", token="the-real-token")
    clusters.append(c)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    c.start_agent(t)
    wait_for(lambda: get_json(f"{t.metrics_url}/healthz")[0] == 200, 60, "trainer agent up", c)
    token = c.token_path.read_bytes()

    # 1. not our protocol at all: garbage instead of a handshake
    hello = _raw(t.ip, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 200)
    assert hello.startswith(b"WSH1")
    # 2. a truncated handshake, then silence and close
    _raw(t.ip, b"WSH1" + b"\x01" * 10)
    # 3. the wrong job token
    with pytest.raises(AuthError):
        connect(t.ip, contract.CONTROL_PORT, b"not-the-token", timeout=5)
    # 4. authenticated, but a first frame of an unknown kind: refused with a reason, link closed
    link = connect(t.ip, contract.CONTROL_PORT, token, timeout=5)
    link.send({"kind": "ws.bogus", "x": 1})
    h, _ = link.recv(timeout=5)
    assert h["kind"] == P.ERROR and "first frame" in h["message"]
    with pytest.raises(LinkError):
        link.recv(timeout=5)
    # 5. authenticated control link: a malformed request gets an error reply, the link stays usable
    link = connect(t.ip, contract.CONTROL_PORT, token, timeout=5)
    link.send({"kind": P.HELLO, "pod": "intruder", "replica": 0, "session": "x"})
    h, _ = link.recv(timeout=5)
    assert h["kind"] == P.WELCOME
    link.send({"kind": P.META_REQ, "id": 1, "version": "not-a-number"})
    h, _ = link.recv(timeout=5)
    assert h["kind"] == P.ERROR and "version" in h["message"]
    link.send({"kind": P.META_REQ, "id": 2, "version": 99})
    h, _ = link.recv(timeout=5)
    assert h["kind"] == P.META and h["ok"] is False and "not staged" in h["error"]
    link.close()
    # 6. authenticated transfer link whose plan inputs are not JSON
    link = connect(t.ip, contract.CONTROL_PORT, token, timeout=5)
    link.send({"kind": P.TRANSFER, "version": 1, "src": 0, "dst": 0, "replica": 0, "group": {}, "plan_hash": "x",
               "proposal": "p"},
              b"{not json")
    h, _ = link.recv(timeout=5)
    assert h["kind"] == P.ERROR and "plan inputs" in h["message"]
    link.close()
    # 7. authenticated, then a frame cut off in the middle (peer dies mid-frame)
    link = connect(t.ip, contract.CONTROL_PORT, token, timeout=5)
    body = json.dumps({"kind": P.HELLO}).encode()
    link._sock.sendall(struct.pack("!4sBBHIQQ", b"WSL1", 1, 0, 0, len(body), 0, 0) + body[:3])
    link._sock.close()
    # 8. authenticated, then a frame with a forged MAC
    link = connect(t.ip, contract.CONTROL_PORT, token, timeout=5)
    link._sock.sendall(struct.pack("!4sBBHIQQ", b"WSL1", 1, 0, 0, len(body), 0, 0) + body + b"\x00" * 32)
    time.sleep(0.3)
    link._sock.close()

    # The agent is alive, says why it rejected each peer, and counts the rejections (each peer is handled in a
    # thread of its own: the counts are awaited, not read once after a fixed sleep).
    code, health = get_json(f"{t.metrics_url}/healthz")
    assert code == 200 and health["ok"]

    def rejected(reason: str) -> float:
        return metric_value(get_text(f"{t.metrics_url}/metrics")[1], "weightsync_agent_rejected_frames_total",
                            f'reason="{reason}"') or 0

    wait_for(lambda: rejected("malformed") >= 1 and rejected("auth") >= 1, 30, "the cut and forged frames counted", c)
    _, metrics = get_text(f"{t.metrics_url}/metrics")
    assert (metric_value(metrics, "weightsync_agent_rejected_connections") or 0) >= 3
    assert (metric_value(metrics, "weightsync_agent_rejected_frames_total", 'reason="protocol"') or 0) >= 3
    assert (metric_value(metrics, "weightsync_agent_rejected_frames_total", 'reason="malformed"') or 0) >= 1
    assert (metric_value(metrics, "weightsync_agent_rejected_frames_total", 'reason="auth"') or 0) >= 1
    log = c.log_text(t, "agent")
    assert "link.reject" in log and "peer.reject" in log
    assert "Traceback" not in log

    # ...and still moves weights bit-exactly.
    c.start_agent(i)
    c.start_engine(i)
    c.start_trainer(t, "--versions", "2", "--interval", "0.3")
    wait_for(lambda: engine_version(i) == 2, 90, "engine at v2 after the attacks", c)
    _, tr = get_json(f"{t.demo_url}/checksums?version=2")
    _, en = get_json(f"{i.demo_url}/checksums")
    assert en["checksums"] == tr["checksums"]


def test_unknown_app_and_bad_publish_are_refused(tmp_path: Path, clusters: list[Cluster]) -> None:
    """The local socket: wrong hello, wrong role, and an inconsistent publish get clear errors."""
    from weightsync.agent.wire import local

    c = Cluster(tmp_path, mode="NCCL")
    clusters.append(c)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    c.start_agent(t)
    sock = tmp_path / t.name / "sock" / contract.AGENT_SOCKET_NAME
    conn = local.connect(sock, timeout=60)
    with pytest.raises(local.LocalProtocolError, match="no engine side"):
        conn.request({"op": "hello", "kind": "inference", "rank": 0})
    conn = local.connect(sock, timeout=10)
    conn.request({"op": "hello", "kind": "trainer", "rank": 0})
    with pytest.raises(local.LocalProtocolError, match="not served by this agent"):
        conn.request({"op": "stage", "version": 1, "rank": 5, "nbytes": 100, "device": "cpu"})
    seg = conn.request({"op": "stage", "version": 1, "rank": 0, "nbytes": 1024, "device": "cpu"})["segment"]
    bad = [{"name": "w", "dtype": "float32", "shape": [4], "global_shape": [4], "global_offset": [0],
            "offset": 0, "nbytes": 4096}]
    with pytest.raises(local.LocalProtocolError, match="nbytes"):
        conn.request({"op": "publish", "version": 1, "rank": 0, "segment": seg["name"], "tensors": bad})
    outside = [{"name": "w", "dtype": "float32", "shape": [4], "global_shape": [4], "global_offset": [2],
                "offset": 0, "nbytes": 16}]
    with pytest.raises(local.LocalProtocolError, match="outside"):
        conn.request({"op": "publish", "version": 1, "rank": 0, "segment": seg["name"], "tensors": outside})
    conn.close()
    code, health = get_json(f"{t.metrics_url}/healthz")
    assert code == 200 and health["published"] is None
