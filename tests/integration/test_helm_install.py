"""`helm install` of the chart into the real control plane (weightsync.e2e.chart: the operator Deployment's
pod run by the process runtime, a host process with the pod's in-cluster ServiceAccount token) serving a
job placed on the operator tests' node pool; `helm uninstall` leaves nothing of the release behind.
The full demo through the chart (versions synced bit for bit) is e2e/tests/test_helm_demo.py."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
from op_helpers import create_job, force_delete_pods, get_job, live_pods, separated_spec

from weightsync.e2e import chart
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


def test_helm_install_runs_the_operator_that_serves_a_job(cluster: Any, kube: Any, namespace: str, wsj_crd: str,
                                                          op_nodes: list[str], process_runtime: Any) -> None:
    if process_runtime is None:
        pytest.skip("no process runtime on this cluster: the operator pod would never run")
    name = f"wso-{secrets.token_hex(2)}"
    release = chart.install_chart(cluster, namespace, name, resync_seconds=2, log_format="json")
    try:
        assert "It serves WeightSyncJobs in" in release.notes  # NOTES.txt
        dep = json.loads(cluster.kubectl("get", "deploy", release.deployment, "-n", namespace, "-o", "json").stdout)
        assert dep["status"].get("readyReplicas") == 1  # the liveness/readiness endpoint answered
        assert release.whoami()["username"] == f"system:serviceaccount:{namespace}:{release.service_account()}"

        create_job(kube, namespace, "helm", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1,
                                                          gpus_per_replica=1))
        wait_until(lambda: len(live_pods(kube, namespace, "helm")) == 2, timeout=90,
                   what="pods from the installed operator")
        job = wait_until(lambda: (j := get_job(kube, namespace, "helm")).get("status", {}).get("conditions") and j,
                         what="status from the installed operator")
        assert job["status"]["observedGeneration"] == 1
        logs = release.logs()
        # logFormat=json: kopf's structured lines, and no 403 anywhere.
        assert any(line.startswith("{") for line in logs.splitlines()), logs[-2000:]
        assert "Forbidden" not in logs, release.diagnostics()

        # The job goes first, while its operator still runs (its finalizer, if any, is removed).
        cluster.kubectl("delete", "wsj", "helm", "-n", namespace, "--wait=false")
        force_delete_pods(kube, namespace)  # pool nodes have no kubelet: deleted pods would stay Terminating
        wait_until(lambda: cluster.kubectl("get", "wsj", "helm", "-n", namespace, check=False).returncode != 0,
                   timeout=60, what="the job deleted")
        release.uninstall()
        wait_until(lambda: not chart.leftovers(cluster, name, namespace), timeout=60, interval=2,
                   what=f"nothing of release {name} left")
    except BaseException:
        print(release.diagnostics())
        raise
    finally:
        if not release.uninstalled:
            release.uninstall()
        for p in kube.core.list_namespaced_pod(namespace).items:
            kube.core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
