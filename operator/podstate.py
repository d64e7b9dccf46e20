"""Reading what the agents and the kubelet report on a pod: readiness, the synced condition, versions.

The agents write `contract.ANN_SERVED_VERSION` / `ANN_PUBLISHED_VERSION` / `ANN_LAST_SYNC` /
`ANN_SYNC_ERROR` annotations and the `contract.POD_CONDITION_SYNCED` condition on their own pod; these
small readers are the only place the operator parses them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from weightsync.crds import contract

Pod = Mapping[str, Any]


def pod_annotations(pod: Pod) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}


def int_annotation(pod: Pod, key: str) -> int | None:
    raw = pod_annotations(pod).get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def condition(pod: Pod, type_: str) -> str | None:
    """The status ("True"/"False"/"Unknown") of a pod condition, None when absent."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("status"))
    return None


def is_terminating(pod: Pod) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def is_live(pod: Pod | None) -> bool:
    return pod is not None and not is_terminating(pod)


def is_scheduled(pod: Pod) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName"))


def is_ready(pod: Pod) -> bool:
    return condition(pod, "Ready") == "True"


def is_synced(pod: Pod) -> bool:
    return condition(pod, contract.POD_CONDITION_SYNCED) == "True"


def unschedulable(pod: Pod) -> str | None:
    """The scheduler's message when it could not place the pod (PodScheduled=False, Unschedulable)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "unschedulable")
    return None


def phase(pod: Pod) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


WAITING_FAILURES = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                    "CreateContainerConfigError", "CreateContainerError", "RunContainerError")
# A container that crashed and runs again still counts as crash-looping for twice the kubelet's current
# back-off (10 s doubling per restart, at most 5 min): a crash loop's short runs between crashes do not flip
# the condition, while one restart (a killed agent) clears within 20 s of running.
CRASH_LOOP_WINDOW_SECONDS = 600.0


def crash_hold_seconds(restarts: int) -> float:
    return min(CRASH_LOOP_WINDOW_SECONDS, 2 * min(300.0, 10.0 * 2 ** max(0, restarts - 1)))


def _parse_time(raw: Any) -> datetime | None:
    if not raw:
        return None
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
    except ValueError:
        return None


def failure_detail(pod: Pod, now: datetime | None = None) -> tuple[str, str] | None:
    """(reason, message naming the pod and container) when the pod is failing: phase Failed, a container
    waiting on an image / config / command error or in CrashLoopBackOff, or one that crashed (non-zero exit,
    OOMKilled) and is running again within the kubelet's back-off window."""
    name = str((pod.get("metadata") or {}).get("name") or "?")
    if phase(pod) == "Failed":
        return "PodFailed", f"pod {name} failed: {(pod.get('status') or {}).get('message') or 'phase Failed'}"
    now = now or datetime.now(timezone.utc)
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    statuses = statuses + ((pod.get("status") or {}).get("containerStatuses") or [])
    for s in statuses:
        waiting = (s.get("state") or {}).get("waiting") or {}
        last = (s.get("lastState") or {}).get("terminated") or {}
        where = f"pod {name} container {s.get('name')}"
        crashed = last.get("reason") == "OOMKilled" or int(last.get("exitCode") or 0) != 0
        why = f"{last.get('reason') or 'Error'} (exit {last.get('exitCode')})" if crashed else ""
        restarts = int(s.get("restartCount") or 0)
        if waiting.get("reason") in WAITING_FAILURES:
            reason = "OOMKilled" if waiting["reason"] == "CrashLoopBackOff" and last.get("reason") == "OOMKilled" \
                else str(waiting["reason"])
            detail = f": last run {why}, {restarts} restarts" if why else ""
            return reason, f"{where}: {waiting['reason']}{detail}: {str(waiting.get('message') or '')[:300]}".rstrip(": ")
        started = _parse_time(((s.get("state") or {}).get("running") or {}).get("startedAt"))
        if crashed and restarts > 0 and started is not None \
                and (now - started).total_seconds() < crash_hold_seconds(restarts):
            reason = "OOMKilled" if last.get("reason") == "OOMKilled" else "CrashLoopBackOff"
            return reason, f"{where}: restarted {restarts} times, last run {why}; running again since {started:%H:%M:%SZ}"
    return None


def failure(pod: Pod, now: datetime | None = None) -> str | None:
    """A short reason when the pod is failing (see failure_detail)."""
    detail = failure_detail(pod, now)
    return detail[0] if detail else None


def condition_detail(pod: Pod, type_: str) -> tuple[str, str] | None:
    """(reason, message) of a pod condition, None when absent."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("reason") or ""), str(c.get("message") or "")
    return None


def condition_since(pod: Pod, type_: str) -> datetime | None:
    """lastTransitionTime of a pod condition (second precision, as the API server stores it), None when
    absent or unreadable."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return _parse_time(c.get("lastTransitionTime"))
    return None


def served_version(pod: Pod) -> int | None:
    return int_annotation(pod, contract.ANN_SERVED_VERSION)


def served_digest(pod: Pod) -> str | None:
    """The content digest of the served version (32 lowercase hex digits), None when absent or malformed."""
    raw = str(pod_annotations(pod).get(contract.ANN_SERVED_DIGEST) or "")
    return raw if len(raw) == 32 and all(c in "0123456789abcdef" for c in raw) else None


def published_version(pod: Pod) -> int | None:
    return int_annotation(pod, contract.ANN_PUBLISHED_VERSION)


def target_version(pod: Pod) -> int | None:
    return int_annotation(pod, contract.ANN_TARGET_VERSION)


def published_epoch(pod: Pod) -> int:
    """The trainer epoch of the published version (0 when absent: agents before epochs, or none yet)."""
    return int_annotation(pod, contract.ANN_PUBLISHED_EPOCH) or 0


def served_epoch(pod: Pod) -> int:
    return int_annotation(pod, contract.ANN_SERVED_EPOCH) or 0


def target_epoch(pod: Pod) -> int:
    return int_annotation(pod, contract.ANN_TARGET_EPOCH) or 0


def engine_paused(pod: Pod) -> bool:
    return pod_annotations(pod).get(contract.ANN_ENGINE_PAUSED) == "true"


def sync_error(pod: Pod) -> str | None:
    return pod_annotations(pod).get(contract.ANN_SYNC_ERROR) or None


def _json_annotation(pod: Pod, key: str) -> dict[str, Any] | None:
    """A JSON object an agent wrote as an annotation; None when absent or not a JSON object."""
    raw = pod_annotations(pod).get(key)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def sync_progress(pod: Pod) -> dict[str, Any] | None:
    """The agent's report of the load under way (contract.ANN_SYNC_PROGRESS), None when none or unreadable."""
    value = _json_annotation(pod, contract.ANN_SYNC_PROGRESS)
    keys = ("version", "bucket", "buckets", "bytes", "totalBytes")
    if value is None or not all(isinstance(value.get(k), int) and value[k] >= 0 for k in keys):
        return None
    return {k: value[k] for k in keys}


def last_sync(pod: Pod) -> dict[str, Any] | None:
    return _json_annotation(pod, contract.ANN_LAST_SYNC)
