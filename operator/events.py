"""Kubernetes Events on the WeightSyncJob (what `kubectl describe wsj` shows).

Posted directly as core/v1 Events rather than through kopf's per-handler event queue, because the
reconciler also runs outside kopf handlers (periodic resync). Messages never carry secret values.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from weightsync.crds import contract
from weightsync.operator.common import JobRef
from weightsync.operator.kube import Kube, KubeError

log = logging.getLogger(__name__)
COMPONENT = "weightsync-operator"
MAX_MESSAGE = 1024


class EventRecorder:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def post(self, job: JobRef, type_: str, reason: str, message: str) -> None:
        """Best effort: a failed Event post is logged, never raised (it must not fail a reconcile)."""
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{job.name}.{uuid.uuid4().hex[:16]}", "namespace": job.namespace},
            "involvedObject": {
                "apiVersion": contract.API_VERSION,
                "kind": contract.KIND,
                "name": job.name,
                "namespace": job.namespace,
                "uid": job.uid,
            },
            "type": type_,
            "reason": reason,
            "message": message[:MAX_MESSAGE],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.kube.create(body)
        except KubeError as err:
            log.warning("event post failed job=%s/%s reason=%s error=%s", job.namespace, job.name, reason, err)

    def normal(self, job: JobRef, reason: str, message: str) -> None:
        self.post(job, "Normal", reason, message)

    def warning(self, job: JobRef, reason: str, message: str) -> None:
        self.post(job, "Warning", reason, message)

    def transitions(self, job: JobRef, previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> None:
        """Post the events `version_events` derives from a status change."""
        for type_, reason, message in version_events(previous, new):
            self.post(job, type_, reason, message)


# --- events derived from status transitions ------------------------------------------------------------
REASON_VERSION_PUBLISHED = "VersionPublished"
REASON_VERSION_SERVED = "VersionServed"
REASON_RECOVERED = "Recovered"
REASON_ATOMIC_PREPARE_FAILED = "AtomicPrepareFailed"  # operator/atomic.py: Synced=False with this reason
EventSpec = tuple[str, str, str]  # (type, reason, message)


def _condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


def _sync_detail(status: Mapping[str, Any], version: int) -> str:
    ls = status.get("lastSync") or {}
    if ls.get("version") != version:
        return ""
    return f" (last sync: {float(ls.get('durationSeconds', 0.0)):.3f}s, {int(ls.get('bytes', 0))} bytes, {ls.get('mode')})"


def version_events(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[EventSpec]:
    """Events for what changed between two aggregated statuses (pure, so each transition is posted once:
    a steady-state pass with an unchanged status posts nothing).

    trainerVersion moved -> Normal VersionPublished; servedVersion moved -> Normal VersionServed with the
    last sync's duration and bytes; Degraded became True or changed reason (SyncFailed, ReplicasStale, a
    failing pod) -> Warning with that reason; Degraded cleared -> Normal Recovered.
    """
    prev = previous or {}
    out: list[EventSpec] = []
    tv_old, tv_new = prev.get("trainerVersion"), new.get("trainerVersion")
    if tv_new is not None and tv_new != tv_old:
        out.append(("Normal", REASON_VERSION_PUBLISHED,
                    f"trainer published version {tv_new}" + (f" (was {tv_old})" if tv_old is not None else "")))
    sv_old, sv_new = prev.get("servedVersion"), new.get("servedVersion")
    if sv_new is not None and sv_new != sv_old:
        out.append(("Normal", REASON_VERSION_SERVED,
                    f"Ready inference replicas serve version {sv_new}" + _sync_detail(new, int(sv_new))))
    d_old, d_new = _condition(prev, contract.COND_DEGRADED), _condition(new, contract.COND_DEGRADED)
    if d_new.get("status") == "True":
        if d_old.get("status") != "True" or d_old.get("reason") != d_new.get("reason"):
            out.append(("Warning", str(d_new.get("reason") or "Degraded"), str(d_new.get("message") or "")))
    elif d_old.get("status") == "True" and d_new.get("status") == "False":
        out.append(("Normal", REASON_RECOVERED, f"no longer degraded (was {d_old.get('reason')})"))
    s_old, s_new = _condition(prev, contract.COND_SYNCED), _condition(new, contract.COND_SYNCED)
    if s_new.get("reason") == REASON_ATOMIC_PREPARE_FAILED and (
            s_old.get("reason") != s_new.get("reason") or s_old.get("message") != s_new.get("message")):
        out.append(("Warning", REASON_ATOMIC_PREPARE_FAILED, str(s_new.get("message") or "")))
    c_old, c_new = _condition(prev, contract.COND_COMPLETE), _condition(new, contract.COND_COMPLETE)
    if c_new.get("status") == "True" and c_old.get("status") != "True":
        out.append(("Normal", str(c_new.get("reason") or "Complete"), str(c_new.get("message") or "")))
    return out
