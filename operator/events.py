"""Kubernetes Events on the WeightSyncJob (what `kubectl describe wsj` shows).

Posted directly as core/v1 Events rather than through kopf's per-handler event queue, because the
reconciler also runs outside kopf handlers (periodic resync). Messages never carry secret values.
"""

from __future__ import annotations

import logging
import uuid
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
