"""Degraded reasons users can act on (issue 16): pod failures named by pod and container, held through the
kubelet's crash back-off (no flip while the container runs between crashes), and EngineUnreachable passed
on from the agent's pod condition."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from weightsync.crds import contract
from weightsync.operator import podstate
from weightsync.operator.placement import plan
from weightsync.operator.status import aggregate

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=timezone.utc)


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod(name: str, container: dict[str, Any] | None = None, conditions: list[dict[str, Any]] | None = None,
         **ann: str) -> dict[str, Any]:
    conds = [{"type": "Ready", "status": "True"}, *(conditions or [])]
    return {"metadata": {"name": name, "uid": name, "annotations": dict(ann)}, "spec": {"nodeName": "n1"},
            "status": {"phase": "Running", "conditions": conds, "containerStatuses": [container] if container else []}}


def _crashed(reason: str = "Error", exit_code: int = 1, restarts: int = 3, running_since: datetime | None = None,
             waiting: str | None = None) -> dict[str, Any]:
    state: dict[str, Any] = ({"waiting": {"reason": waiting, "message": "back-off 40s restarting failed container"}}
                             if waiting else {"running": {"startedAt": _stamp(running_since or NOW)}})
    return {"name": "engine", "restartCount": restarts, "state": state,
            "lastState": {"terminated": {"reason": reason, "exitCode": exit_code}}}


def test_a_crash_loop_is_held_while_the_container_runs_between_crashes() -> None:
    waiting = _pod("p", _crashed(waiting="CrashLoopBackOff"))
    running = _pod("p", _crashed(running_since=NOW - timedelta(seconds=20)))
    assert podstate.failure(waiting, NOW) == "CrashLoopBackOff"
    reason, message = podstate.failure_detail(running, NOW) or ("", "")
    assert reason == "CrashLoopBackOff", "running again after a crash must not clear the failure"
    assert "pod p container engine" in message and "restarted 3 times" in message and "exit 1" in message
    # after the back-off window of running without a crash, it is healthy again
    assert podstate.failure(_pod("p", _crashed(running_since=NOW - timedelta(minutes=11))), NOW) is None
    # one restart (an agent killed once) clears after 20 s of running; a long loop holds up to 10 minutes
    once = _crashed(restarts=1, running_since=NOW - timedelta(seconds=25))
    assert podstate.failure(_pod("p", once), NOW) is None
    looping = _crashed(restarts=8, running_since=NOW - timedelta(minutes=9))
    assert podstate.failure(_pod("p", looping), NOW) == "CrashLoopBackOff"
    # a clean exit (restartPolicy Always restarts it) is not a crash
    assert podstate.failure(_pod("p", _crashed(reason="Completed", exit_code=0)), NOW) is None


def test_oom_image_and_command_failures_are_named() -> None:
    oom = _pod("p", _crashed(reason="OOMKilled", exit_code=137, waiting="CrashLoopBackOff"))
    assert podstate.failure(oom, NOW) == "OOMKilled"
    assert "OOMKilled (exit 137)" in (podstate.failure_detail(oom, NOW) or ("", ""))[1]
    oom_running = _pod("p", _crashed(reason="OOMKilled", exit_code=137, running_since=NOW))
    assert podstate.failure(oom_running, NOW) == "OOMKilled"
    for reason in ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerError", "RunContainerError"):
        pod = _pod("p", {"name": "engine", "restartCount": 0, "state": {"waiting": {"reason": reason, "message": "m"}}})
        detail = podstate.failure_detail(pod, NOW)
        assert detail is not None and detail[0] == reason and "pod p container engine" in detail[1]


def test_engine_unreachable_from_the_agent_becomes_the_jobs_degraded_reason(separated) -> None:
    spec = separated()
    p = plan("demo", spec)
    msg = "the SGLang engine has not been reachable for 31s: GET http://10.0.0.5:8999/model_info failed"
    cond = {"type": contract.POD_CONDITION_SYNCED, "status": "False", "reason": contract.REASON_ENGINE_UNREACHABLE,
            "message": msg}
    pods = {n: _pod(n) for n in p.names}
    first = next(n for n in p.names if "inference" in n)
    pods[first] = _pod(first, conditions=[cond])
    st = aggregate(spec, 1, p, pods, None, 1, now=NOW)
    degraded = next(c for c in st.conditions if c.type == contract.COND_DEGRADED)
    assert (degraded.status, degraded.reason) == ("True", "EngineUnreachable")
    assert first in degraded.message and "http://10.0.0.5:8999" in degraded.message
    (rep,) = [r for r in st.inference_replicas or [] if first in r.pods]
    assert rep.last_error == msg
