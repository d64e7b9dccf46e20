"""The job's headless Service: stable DNS names `<pod>.<job>.<ns>.svc` for every owned pod."""

from __future__ import annotations

from typing import Any

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJobSpec
from weightsync.operator.common import JobRef, job_selector, metadata


def build_service(job: JobRef, spec: WeightSyncJobSpec) -> dict[str, Any]:
    """Headless and publishing not-ready addresses: inference pods are NotReady until their first sync
    (readiness gate), yet agents must find each other to perform that sync."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, contract.service_name(job.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job_selector(job),
            "ports": [
                {"name": "ws-control", "port": contract.CONTROL_PORT, "targetPort": contract.CONTROL_PORT, "protocol": "TCP"},
                {"name": "ws-metrics", "port": contract.METRICS_PORT, "targetPort": contract.METRICS_PORT, "protocol": "TCP"},
                {"name": "ws-transport", "port": contract.TRANSPORT_PORT, "targetPort": contract.TRANSPORT_PORT, "protocol": "TCP"},
                {"name": "engine", "port": spec.inference.engine.port, "targetPort": spec.inference.engine.port, "protocol": "TCP"},
            ],
        },
    }
