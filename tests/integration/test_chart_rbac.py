"""The chart's namespaced RBAC is enough: the real operator, authenticated as the chart's
ServiceAccount (a TokenRequest token, no admin rights), builds a whole job."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_helpers import create_job, get_job, live_pods, separated_spec, start_operator, token_kubeconfig
from weightsync.crds import contract
from weightsync.e2e.binaries import find_binary
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[2] / "helm" / "weightsync-operator"


def test_operator_runs_with_only_the_charts_namespaced_role(cluster: Any, kube: Any, namespace: str, wsj_crd: str,
                                                            op_nodes: list[str], tmp_path: Path) -> None:
    rendered = subprocess.run(
        [str(find_binary("helm")), "template", "ws", str(CHART), "-n", namespace, "--kube-version", "1.34.4",
         "--set", f"watchNamespaces={{{namespace}}}"],
        capture_output=True, text=True, check=True,
    ).stdout
    rbac = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert sorted(d["kind"] for d in rbac) == ["Role", "RoleBinding", "ServiceAccount"]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    sa = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
    kubeconfig = token_kubeconfig(Path(cluster.kubeconfig), token, tmp_path / "operator.kubeconfig")

    op = start_operator(kubeconfig, namespace, tmp_path)
    try:
        create_job(kube, namespace, "rbac", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
        wait_until(lambda: len(live_pods(kube, namespace, "rbac")) == 2, timeout=60, what="pods created by the operator")
        job = wait_until(lambda: (j := get_job(kube, namespace, "rbac")).get("status", {}).get("conditions") and j,
                         what="status written")
        assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
        for name in ("rbac-token",):
            assert kube.core.read_namespaced_secret(name, namespace)
        assert kube.core.read_namespaced_config_map("rbac-topology", namespace)
        assert kube.rbac.read_namespaced_role("rbac-agent", namespace)  # granting needs what it grants
        wait_until(lambda: any(e.reason == "Created" for e in kube.core.list_namespaced_event(namespace).items
                               if e.involved_object.kind == contract.KIND), what="Created event")
        log = op.log()
        assert "Forbidden" not in log and " 403" not in log and "reconcile failed" not in log, log[-3000:]
        assert op.alive()
    finally:
        op.stop()
        for p in kube.core.list_namespaced_pod(namespace).items:
            kube.core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
