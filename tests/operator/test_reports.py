"""Reports pushed by agents to the operator (crds/report_push.py, operator/reports.py): signed, bounded,
taken only from a job's own pods by the active replica, laid over the pod until the pod catches up; the
listener has limits and deadlines. The agent side is the real PodLink push (agent/podstatus.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from weightsync.agent.podstatus import push_report, report_write_delay
from weightsync.crds import contract, desired, report_push, version_proof
from weightsync.crds.report_push import BadReport
from weightsync.operator import podstate, proofs
from weightsync.operator.common import JobRef
from weightsync.operator.config import OperatorConfig
from weightsync.operator.reports import ReportBox, ReportIntake, ReportServer

KEY = b"k" * 64
JOB = JobRef(name="grpo", namespace="rl", uid="job-uid")
TOKEN = proofs.token_for(KEY, JOB)
assert TOKEN is not None


def _served(uid: str, version: int, token: str = TOKEN) -> dict[str, str | None]:
    ann: dict[str, str | None] = {contract.ANN_SERVED_VERSION: str(version), contract.ANN_SERVED_EPOCH: "0",
                                  contract.ANN_LAST_SYNC: json.dumps({"version": version})}
    ann[contract.ANN_VERSION_PROOF] = version_proof.version_proof(token, uid, ann)
    return ann


def _body(pod: str, uid: str, seq: int, ann: dict[str, str | None], token: str = TOKEN, job: str = "grpo") -> bytes:
    return report_push.build(token, "rl", job, pod, uid, seq, ann)


def _pod(name: str, uid: str, ann: dict[str, Any] | None = None, owner: str = "job-uid") -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "rl", "uid": uid, "annotations": dict(ann or {}),
                                        "ownerReferences": [{"uid": owner, "controller": True, "kind": contract.KIND}]}}


# --- the report itself ---------------------------------------------------------------------------------
def test_a_report_round_trips_and_any_change_breaks_its_signature() -> None:
    raw = _body("p0", "u0", 5, _served("u0", 3))
    rep = report_push.parse(raw)
    assert (rep.namespace, rep.job, rep.pod, rep.uid, rep.seq) == ("rl", "grpo", "p0", "u0", 5)
    assert report_push.verify(TOKEN, rep)
    doc = json.loads(raw)
    for field, value in (("seq", 6), ("uid", "u1"), ("pod", "p1"), ("job", "other")):
        assert not report_push.verify(TOKEN, report_push.parse(json.dumps({**doc, field: value}).encode())), field
    doc["annotations"][contract.ANN_SYNC_ERROR] = "forged"
    assert not report_push.verify(TOKEN, report_push.parse(json.dumps(doc).encode()))
    assert not report_push.verify("0" * 64, rep), "another job's token"


def test_only_what_an_agent_reports_and_only_bounded_reports_are_parsed() -> None:
    doc = json.loads(_body("p0", "u0", 5, _served("u0", 3)))
    with pytest.raises(BadReport, match="not something an agent reports"):
        report_push.parse(json.dumps({**doc, "annotations": {contract.ANN_TARGET_VERSION: "9"}}).encode())
    with pytest.raises(BadReport, match="over"):
        report_push.parse(b"{" + b" " * report_push.MAX_BODY_BYTES + b"}")
    with pytest.raises(BadReport, match="at most"):
        report_push.parse(json.dumps({**doc, "annotations": {contract.ANN_SYNC_ERROR: "x" * 10_000}}).encode())
    for bad in ({"seq": -1}, {"seq": True}, {"seq": "5"}, {"pod": ""}, {"mac": "00"}, {"annotations": []}):
        with pytest.raises(BadReport):
            report_push.parse(json.dumps({**doc, **bad}).encode())
    with pytest.raises(BadReport, match="not JSON"):
        report_push.parse(b"{nope")
    # build leaves out anything that is not reported (the desired annotations are the operator's)
    built = json.loads(_body("p0", "u0", 1, {**_served("u0", 3), contract.ANN_TARGET_VERSION: "9"}))
    assert contract.ANN_TARGET_VERSION not in built["annotations"]


def test_the_report_address_comes_only_from_the_desired_state_and_only_as_an_http_url() -> None:
    cfg = OperatorConfig(operator_key=KEY, report_address="10.0.0.5", report_port=8082)
    assert cfg.report_url == "http://10.0.0.5:8082/v1/reports"
    assert OperatorConfig(operator_key=None, report_address="10.0.0.5").report_url is None, "nothing could be checked"
    assert OperatorConfig(operator_key=KEY, report_address="").report_url is None
    assert OperatorConfig(operator_key=KEY, report_address="fd00::5").report_url == "http://[fd00::5]:8082/v1/reports"
    data = desired.encode({"p0": {contract.ANN_TARGET_VERSION: "3"}}, cfg.report_url)
    assert desired.report_to(data) == cfg.report_url
    assert desired.decode_pod(data, "p0") == {contract.ANN_TARGET_VERSION: "3"}
    with_instance = OperatorConfig(operator_key=KEY, report_address="10.0.0.5", report_instance="0a1b2c").report_url
    assert with_instance == "http://10.0.0.5:8082/v1/reports?instance=0a1b2c"
    assert desired.report_to({contract.DESIRED_REPORT_TO_KEY: with_instance}) == with_instance
    for bad in ("file:///etc/passwd", "http://x/other", "ftp://x:1/v1/reports", "http://x/v1/reports",
                "http://" + "x" * 600 + ":1/v1/reports", "http://x:1/v1/reports?other=1", "http://u@x:1/v1/reports",
                "http://x:99999/v1/reports", "http://x:1/v1/reports#f"):
        assert desired.report_to({contract.DESIRED_REPORT_TO_KEY: bad}) is None, bad
    assert report_write_delay({}) == 10.0
    assert report_write_delay({contract.ENV_REPORT_WRITE_DELAY: "0.5"}) == 0.5
    assert report_write_delay({contract.ENV_REPORT_WRITE_DELAY: "soon"}) == 10.0
    assert report_write_delay({contract.ENV_REPORT_WRITE_DELAY: "-3"}) == 0.0


# --- held and laid over the pods -------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_held_report_stands_until_the_pod_catches_up_and_never_goes_back() -> None:
    clock = Clock()
    box = ReportBox(clock=clock, hold_seconds=30.0)
    old = _served("u0", 2)
    pods = {"p0": _pod("p0", "u0", {**old, contract.ANN_TARGET_VERSION: "3", "other": "kept"}), "p1": _pod("p1", "u1")}
    assert box.record(report_push.parse(_body("p0", "u0", 10, _served("u0", 3))))
    seen = box.overlay("rl", "grpo", pods)
    assert podstate.served_version(seen["p0"]) == 3
    ann = seen["p0"]["metadata"]["annotations"]
    assert ann[contract.ANN_TARGET_VERSION] == "3" and ann["other"] == "kept", "only the reported keys are replaced"
    assert proofs.believed(seen, TOKEN)[1] == [], "the pushed version carries the agent's proof"
    assert podstate.served_version(pods["p0"]) == 2, "the cached pods are not mutated"
    # an older or replayed report of the same pod is refused
    assert not box.record(report_push.parse(_body("p0", "u0", 10, _served("u0", 3))))
    assert not box.record(report_push.parse(_body("p0", "u0", 9, _served("u0", 1))))
    # the pod catches up: the report is dropped, the pod stands
    pods["p0"] = _pod("p0", "u0", _served("u0", 3))
    assert podstate.served_version(box.overlay("rl", "grpo", pods)["p0"]) == 3
    assert box.held("rl", "grpo") == 0
    assert not box.record(report_push.parse(_body("p0", "u0", 10, _served("u0", 3)))), "still never goes back"


def test_a_held_report_is_dropped_for_a_new_pod_incarnation_a_gone_pod_and_after_the_hold() -> None:
    clock = Clock()
    box = ReportBox(clock=clock, hold_seconds=30.0)
    for pod, uid in (("p0", "u0"), ("p1", "u1"), ("p2", "u2")):
        assert box.record(report_push.parse(_body(pod, uid, 1, _served(uid, 3))))
    pods = {"p0": _pod("p0", "u0-new"), "p2": _pod("p2", "u2")}  # p0 re-created, p1 gone
    seen = box.overlay("rl", "grpo", pods)
    assert podstate.served_version(seen["p0"]) is None and "p1" not in seen
    assert podstate.served_version(seen["p2"]) == 3
    assert box.record(report_push.parse(_body("p0", "u0-new", 1, _served("u0-new", 1)))), "a new uid starts afresh"
    clock.now += 31
    assert podstate.served_version(box.overlay("rl", "grpo", pods)["p2"]) is None, "the pod stands after the hold"
    box.forget("rl", "grpo")
    assert box.held("rl", "grpo") == 0


# --- taken by the active replica from the job's own pods --------------------------------------------------
class Intake:
    def __init__(self) -> None:
        self.active = True
        self.requested: list[tuple[str, str]] = []
        self.box = ReportBox()
        self.objects = {(contract.KIND, "rl", "grpo"): {"metadata": {"name": "grpo", "namespace": "rl", "uid": "job-uid"}},
                        ("Pod", "rl", "p0"): _pod("p0", "u0"),
                        ("Pod", "rl", "stranger"): _pod("stranger", "us", owner="another-job")}
        self.intake = ReportIntake(self.box, lambda k, ns, n: self.objects.get((k, ns, n)),
                                   lambda job: proofs.token_for(KEY, JobRef.from_body(job)),
                                   lambda: self.active, self.requested.append)


def test_the_intake_takes_only_signed_reports_of_the_jobs_own_pods_on_the_active_replica() -> None:
    it = Intake()
    code, _ = it.intake.take(_body("p0", "u0", 1, _served("u0", 3)))
    assert code == 200 and it.requested == [("rl", "grpo")] and it.box.held("rl", "grpo") == 1
    assert it.intake.take(_body("p0", "u0", 1, _served("u0", 3)))[0] == 409, "a replay"
    assert it.intake.take(_body("p0", "u0", 2, _served("u0", 4), token="0" * 64))[0] == 403
    assert it.intake.take(_body("p0", "u-old", 3, _served("u-old", 4)))[0] == 404, "another incarnation"
    assert it.intake.take(_body("stranger", "us", 3, _served("us", 4)))[0] == 404, "another job's pod"
    assert it.intake.take(_body("nope", "u9", 3, _served("u9", 4)))[0] == 404
    assert it.intake.take(_body("p0", "u0", 3, _served("u0", 4), job="other"))[0] == 404
    assert it.intake.take(b"[]")[0] == 400
    it.active = False
    assert it.intake.take(_body("p0", "u0", 4, _served("u0", 5)))[0] == 503, "a standby takes nothing"
    assert len(it.requested) == 1


# --- the listener ------------------------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[tuple[ReportServer, Intake]]:
    it = Intake()
    srv = ReportServer(it.intake.take, host="127.0.0.1", port=0, max_connections=4, deadline_seconds=0.5,
                       max_per_address=3)
    loop = asyncio.new_event_loop()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(5)
    yield srv, it
    asyncio.run_coroutine_threadsafe(srv.stop(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def _raw(port: int, data: bytes, wait: float = 2.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        return out


def test_the_listener_takes_an_agents_push_and_answers_everything_else_with_a_clear_status(server: Any) -> None:
    srv, it = server
    url = f"http://127.0.0.1:{srv.port}{contract.REPORT_PATH}"
    assert push_report(url + "?instance=0a1b", _body("p0", "u0", 1, _served("u0", 3))) == (200, "taken")
    assert podstate.served_version(it.box.overlay("rl", "grpo", {"p0": _pod("p0", "u0")})["p0"]) == 3
    code, msg = push_report(url, _body("p0", "u0", 2, _served("u0", 4), token="0" * 64))
    assert code == 403 and "token" in msg
    assert push_report(f"http://127.0.0.1:{srv.port}/other", b"{}")[0] == 404
    assert _raw(srv.port, b"GET /v1/reports HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 405")
    assert _raw(srv.port, b"POST /v1/reports HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 411")
    big = report_push.MAX_BODY_BYTES + 1
    assert _raw(srv.port, f"POST /v1/reports HTTP/1.1\r\nContent-Length: {big}\r\n\r\n".encode()).startswith(
        b"HTTP/1.1 413")
    assert _raw(srv.port, b"POST /v1/reports HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert push_report("http://127.0.0.1:1/v1/reports", b"{}")[0] == 0, "no answer: the agent writes its pod"


def test_the_listener_has_a_deadline_and_a_bound_on_connections(server: Any) -> None:
    srv, _ = server
    t0 = time.monotonic()
    # a client that never finishes its body is cut off at the deadline
    answer = _raw(srv.port, b"POST /v1/reports HTTP/1.1\r\nContent-Length: 100\r\n\r\n{", wait=5)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3
    srv.deadline_seconds = 10.0  # the connections below are held while the bound is probed: none may time out meanwhile
    # slow clients beyond the bound of one address are turned away at once, not queued; another address
    # still gets through, until the bound of all connections
    held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
    try:
        time.sleep(0.1)
        assert _raw(srv.port, b"").startswith(b"HTTP/1.1 503")
        other = socket.create_connection(("127.0.0.1", srv.port), source_address=("127.0.0.2", 0))
        held.append(other)
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=2, source_address=("127.0.0.3", 0)) as s:
            assert s.recv(4096).startswith(b"HTTP/1.1 503"), "all 4 connections are taken"
        other.sendall(b"GET /v1/reports HTTP/1.1\r\n\r\n")
        assert other.recv(4096).startswith(b"HTTP/1.1 405"), "the other address was served"
    finally:
        for s in held:
            s.close()


def test_a_resync_spreads_the_jobs_passes_over_half_its_period() -> None:
    """A resync used to ask for every job's pass at once: with 100 jobs, the pass a busy job's pushed
    reports were waiting for queued behind the burst."""
    from weightsync.operator.handlers import spread_gap

    assert spread_gap(30.0, 100) == pytest.approx(0.15)
    assert spread_gap(30.0, 100) * 100 == pytest.approx(15.0)
    assert spread_gap(30.0, 1) == 0.0 and spread_gap(30.0, 0) == 0.0

