"""Pod status from container states (pure): phase, conditions, container statuses, the status patch.

The runtime owns only the kubelet's condition types; every other condition on the pod (readiness-gate
conditions such as weightsync.io/synced written by the agent, PodScheduled from the scheduler) is read,
never written: conditions are a strategic-merge list keyed by `type`, so patching ours keeps theirs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

KIND_INIT = "init"
KIND_SIDECAR = "sidecar"
KIND_APP = "app"
OWN_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


@dataclass(frozen=True)
class ContainerView:
    """What the status needs to know about one container at one instant."""

    name: str
    kind: str
    image: str
    state: JSON  # exactly one of {"waiting": {...}}, {"running": {...}}, {"terminated": {...}}
    last_state: JSON = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str = ""

    @property
    def running(self) -> bool:
        return "running" in self.state

    @property
    def terminated(self) -> JSON | None:
        return self.state.get("terminated")


def container_status(view: ContainerView) -> JSON:
    """The ContainerStatus JSON (containerStatuses is an atomic list: always sent whole)."""
    status: JSON = {
        "name": view.name,
        "image": view.image,
        "imageID": "",
        "state": view.state,
        "lastState": view.last_state,
        "ready": view.ready,
        "restartCount": view.restart_count,
        "started": view.started,
    }
    if view.container_id:
        status["containerID"] = view.container_id
    return status


def pod_phase(restart_policy: str, initialized: bool, init_failed: bool, apps: Sequence[ContainerView]) -> str:
    """The kubelet's phase rule over the regular containers."""
    if init_failed:
        return "Failed"
    if not initialized:
        return "Pending"
    running = waiting = stopped = succeeded = 0
    for view in apps:
        term = view.terminated
        if view.running:
            running += 1
        elif term is not None:
            stopped += 1
            succeeded += term.get("exitCode") == 0
        elif view.last_state.get("terminated"):
            stopped += 1
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        if restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        if restart_policy == "Never":
            return "Failed"
        return "Running"
    return "Pending"


def _condition_status(conditions: Sequence[JSON], ctype: str) -> str | None:
    for cond in conditions:
        if cond.get("type") == ctype:
            return str(cond.get("status"))
    return None


def readiness(
    spec: JSON, existing_conditions: Sequence[JSON], views: Sequence[ContainerView], phase: str
) -> tuple[bool, str, str, bool, str, str]:
    """(containersReady, reason, message, ready, reason, message) with readiness gates applied."""
    counted = [v for v in views if v.kind in (KIND_APP, KIND_SIDECAR)]
    unready = [v.name for v in counted if not v.ready]
    if phase == "Succeeded":
        return False, "PodCompleted", "", False, "PodCompleted", ""
    if unready:
        msg = f"containers with unready status: [{' '.join(unready)}]"
        return False, "ContainersNotReady", msg, False, "ContainersNotReady", msg
    gate_problems = []
    for gate in spec.get("readinessGates") or []:
        ctype = gate.get("conditionType", "")
        value = _condition_status(existing_conditions, ctype)
        if value is None:
            gate_problems.append(f'corresponding condition of pod readiness gate "{ctype}" does not exist.')
        elif value != "True":
            gate_problems.append(f'the status of pod readiness gate "{ctype}" is not "True", but {value}')
    if gate_problems:
        return True, "", "", False, "ReadinessGatesNotReady", ", ".join(gate_problems)
    return True, "", "", True, "", ""


def own_conditions(
    spec: JSON,
    existing_conditions: Sequence[JSON],
    views: Sequence[ContainerView],
    sandbox_ready: bool,
    initialized: bool,
    phase: str,
    transitions: Mapping[str, tuple[str, str]],
    now: str,
) -> list[JSON]:
    """Our four conditions; lastTransitionTime kept from `transitions` (type -> (status, time)) unless
    the status flips."""
    containers_ready, cr_reason, cr_msg, ready, r_reason, r_msg = readiness(spec, existing_conditions, views, phase)
    init_reason = "" if initialized else "ContainersNotInitialized"
    pending_init = [v.name for v in views if v.kind == KIND_INIT and not v.terminated]
    init_msg = "" if initialized else f"containers with incomplete status: [{' '.join(pending_init)}]"
    wanted = [
        ("PodReadyToStartContainers", sandbox_ready, "", ""),
        ("Initialized", initialized, init_reason, init_msg),
        ("ContainersReady", containers_ready, cr_reason, cr_msg),
        ("Ready", ready, r_reason, r_msg),
    ]
    out = []
    for ctype, ok, reason, message in wanted:
        status = "True" if ok else "False"
        prev = transitions.get(ctype)
        when = prev[1] if prev is not None and prev[0] == status else now
        cond: JSON = {"type": ctype, "status": status, "lastProbeTime": None, "lastTransitionTime": when}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        out.append(cond)
    return out


def status_patch(
    pod: JSON,
    views: Sequence[ContainerView],
    *,
    pod_ip: str,
    host_ip: str,
    start_time: str,
    sandbox_ready: bool,
    initialized: bool,
    init_failed: bool,
    transitions: Mapping[str, tuple[str, str]],
    now: str,
) -> JSON:
    """The strategic-merge patch body for pods/status."""
    spec = pod.get("spec", {})
    existing = (pod.get("status") or {}).get("conditions") or []
    apps = [v for v in views if v.kind == KIND_APP]
    inits = [v for v in views if v.kind != KIND_APP]
    phase = pod_phase(spec.get("restartPolicy", "Always"), initialized, init_failed, apps)
    return {
        "status": {
            "phase": phase,
            "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}],
            "hostIP": host_ip,
            "hostIPs": [{"ip": host_ip}],
            "startTime": start_time,
            "qosClass": (pod.get("status") or {}).get("qosClass") or "BestEffort",
            "conditions": own_conditions(
                spec, existing, views, sandbox_ready, initialized, phase, transitions, now
            ),
            "containerStatuses": [container_status(v) for v in apps],
            "initContainerStatuses": [container_status(v) for v in inits],
        }
    }


def comparable(patch: JSON) -> JSON:
    """The patch without timestamps that do not mean a change (for 'is a new patch needed')."""
    status = dict(patch.get("status", {}))
    status["conditions"] = [
        {k: v for k, v in c.items() if k not in ("lastTransitionTime", "lastProbeTime")}
        for c in status.get("conditions", [])
    ]
    return status
