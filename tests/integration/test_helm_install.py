"""`helm install` of the chart into the real control plane, the operator Deployment's pod run by the
process runtime (a host process with the pod's in-cluster ServiceAccount token), serving a job."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from op_helpers import create_job, free_port, get_job, live_pods, separated_spec
from weightsync.e2e.binaries import find_binary
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

CHART = Path(__file__).resolve().parents[2] / "helm" / "weightsync-operator"


def test_helm_install_runs_the_operator_that_serves_a_job(cluster: Any, kube: Any, namespace: str, wsj_crd: str,
                                                          op_nodes: list[str], process_runtime: Any) -> None:
    if process_runtime is None:
        pytest.skip("no process runtime on this cluster: the operator pod would never run")
    helm = str(find_binary("helm"))
    release = "wso"
    args = [
        helm, "install", release, str(CHART), "-n", namespace, "--kubeconfig", str(cluster.kubeconfig),
        "--set", f"watchNamespaces={{{namespace}}}",
        # Host processes share the host's ports: pick free ones.
        "--set", f"metrics.port={free_port()}", "--set", f"health.port={free_port()}",
        "--set", "operator.resyncSeconds=2", "--set", "operator.logFormat=json",
        "--set-string", "nodeSelector.weightsync\\.io/process-node=true",
        "--wait", "--timeout", "60s",
    ]
    r = subprocess.run(args, capture_output=True, text=True, timeout=180)

    def diagnostics() -> str:
        out = [cluster.kubectl(*a, "-n", namespace, check=False) for a in (
            ("get", "pods", "-o", "wide"), ("describe", "pods", "-l", "app.kubernetes.io/instance=" + release),
            ("logs", f"deploy/{release}-weightsync-operator", "--tail=60"))]
        text = "\n".join(o.stdout[-3000:] + o.stderr[-500:] for o in out)
        for p in kube.core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={release}").items:
            path = Path(process_runtime.log_path(namespace, p.metadata.name, "operator"))
            if path.exists():
                text += f"\n--- {path}\n" + path.read_text(errors="replace")[-4000:]
        return text

    try:
        assert r.returncode == 0, r.stdout + r.stderr + diagnostics()
        assert "It serves WeightSyncJobs in" in r.stdout  # NOTES.txt
        dep = json.loads(cluster.kubectl("get", "deploy", f"{release}-weightsync-operator", "-n", namespace,
                                         "-o", "json").stdout)
        assert dep["status"].get("readyReplicas") == 1  # the liveness/readiness endpoint answered

        create_job(kube, namespace, "helm", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1,
                                                          gpus_per_replica=1))
        wait_until(lambda: len(live_pods(kube, namespace, "helm")) == 2, timeout=90, what="pods from the installed operator")
        job = wait_until(lambda: (j := get_job(kube, namespace, "helm")).get("status", {}).get("conditions") and j,
                         what="status from the installed operator")
        assert job["status"]["observedGeneration"] == 1
        logs = cluster.kubectl("logs", f"deploy/{release}-weightsync-operator", "-n", namespace, check=False).stdout
        assert "Forbidden" not in logs, diagnostics()
    finally:
        subprocess.run([helm, "uninstall", release, "-n", namespace, "--kubeconfig", str(cluster.kubeconfig),
                        "--wait", "--timeout", "60s"], capture_output=True, text=True, timeout=120)
        for p in kube.core.list_namespaced_pod(namespace).items:
            kube.core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
