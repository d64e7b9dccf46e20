"""The job's two Services.

`<job>` (headless, peer discovery): stable DNS names `<pod>.<job>.<ns>.svc` for every owned pod, not-ready
ones included. `<job>-inference` (routing): a ClusterIP Service on the engine port that selects only the
inference frontends (the pod of each replica that serves HTTP) and, like any Service, only Ready ones, so
the readiness gate `weightsync.io/synced` really takes a stale or loading replica out of rotation.
"""

from __future__ import annotations

from typing import Any

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJobSpec
from weightsync.operator.common import JobRef, job_selector, metadata
from weightsync.operator.placement import Plan


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


def routing_selector(job: JobRef, plan: Plan) -> dict[str, str]:
    """Inference frontends: Separated replicas serve HTTP from their first pod (rank label 0); Colocated pods
    each hold whole replicas (or one pod per replica), so every colocated pod serves."""
    selector = {**job_selector(job)}
    if any(p.is_inference and p.role == contract.ROLE_COLOCATED for p in plan.pods):
        selector[contract.LABEL_ROLE] = contract.ROLE_COLOCATED
    else:
        selector[contract.LABEL_ROLE] = contract.ROLE_INFERENCE
        selector[contract.LABEL_RANK] = "0"
    return selector


def build_routing_service(job: JobRef, spec: WeightSyncJobSpec, plan: Plan) -> dict[str, Any]:
    port = spec.inference.engine.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, contract.routing_service_name(job.name)),
        "spec": {
            "type": "ClusterIP",
            "publishNotReadyAddresses": False,
            "selector": routing_selector(job, plan),
            "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
