"""Per-job ServiceAccount, Role and RoleBinding for the agents: least privilege by resourceNames.

An agent watches and patches only its own job's pods (the served version and the synced condition go out
through the pod and pods/status) and reads only the job's topology and desired-state ConfigMaps (target
version, pause, membership generation and the Atomic commit come in through the latter). A single-object watch is a list/watch with fieldSelector metadata.name=<pod>,
which the RBAC authorizer matches against resourceNames, so list and watch are granted with names too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from weightsync.crds import contract
from weightsync.operator.common import JobRef, metadata

RBAC_API = "rbac.authorization.k8s.io/v1"


def build_service_account(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(job, contract.service_account_name(job.name)),
    }


def role_name(job: str) -> str:
    return contract.service_account_name(job)


def build_role(job: JobRef, pod_names: Iterable[str]) -> dict[str, Any]:
    names = sorted(set(pod_names))
    return {
        "apiVersion": RBAC_API,
        "kind": "Role",
        "metadata": metadata(job, role_name(job.name)),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": names, "verbs": ["get", "list", "watch", "patch"]},
            {"apiGroups": [""], "resources": ["pods/status"], "resourceNames": names, "verbs": ["get", "patch"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [contract.topology_configmap_name(job.name), contract.desired_configmap_name(job.name)],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }


def build_role_binding(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": RBAC_API,
        "kind": "RoleBinding",
        "metadata": metadata(job, role_name(job.name)),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name(job.name)},
        "subjects": [
            {"kind": "ServiceAccount", "name": contract.service_account_name(job.name), "namespace": job.namespace}
        ],
    }
