"""The chart's namespaced RBAC is enough: the real operator, authenticated as the chart's
ServiceAccount (a TokenRequest token, no admin rights), builds a whole job."""

from __future__ import annotations

import copy
import subprocess
import time
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


def rendered_rbac(namespace: str) -> list[dict[str, Any]]:
    """The chart's ServiceAccount, Role and RoleBinding for a namespaced install into NAMESPACE."""
    rendered = subprocess.run(
        [str(find_binary("helm")), "template", "ws", str(CHART), "-n", namespace, "--kube-version", "1.34.4",
         "--set", f"watchNamespaces={{{namespace}}}"],
        capture_output=True, text=True, check=True,
    ).stdout
    rbac = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert sorted(d["kind"] for d in rbac) == ["Role", "RoleBinding", "ServiceAccount"]
    return rbac


def operator_kubeconfig(cluster: Any, namespace: str, rbac: list[dict[str, Any]], tmp_path: Path) -> Path:
    """Apply RBAC and return a kubeconfig that authenticates as its ServiceAccount (no admin rights)."""
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    sa = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
    token = cluster.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
    return token_kubeconfig(Path(cluster.kubeconfig), token, tmp_path / "operator.kubeconfig")


def without_verb(rbac: list[dict[str, Any]], resource: str, verb: str) -> list[dict[str, Any]]:
    """RBAC with one verb on one resource taken away (the rule must have held it)."""
    out = copy.deepcopy(rbac)
    role = next(d for d in out if d["kind"] == "Role")
    rule = next(r for r in role["rules"] if resource in r["resources"])
    assert verb in rule["verbs"], (resource, verb, rule)
    rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return out


def test_operator_runs_with_only_the_charts_namespaced_role(cluster: Any, kube: Any, namespace: str, wsj_crd: str,
                                                            op_nodes: list[str], tmp_path: Path) -> None:
    kubeconfig = operator_kubeconfig(cluster, namespace, rendered_rbac(namespace), tmp_path)

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


def _events(kube: Any, namespace: str, reason: str) -> list[Any]:
    return [e for e in kube.core.list_namespaced_event(namespace).items
            if e.involved_object.kind == contract.KIND and e.reason == reason]


def test_a_missing_pod_permission_fails_loudly(cluster: Any, kube: Any, namespace: str, wsj_crd: str,
                                               op_nodes: list[str], tmp_path: Path) -> None:
    """The chart's Role without `create pods`: the job says so (condition + Event), the log says so, and
    giving the permission back heals the job without restarting the operator."""
    rbac = rendered_rbac(namespace)
    kubeconfig = operator_kubeconfig(cluster, namespace, without_verb(rbac, "pods", "create"), tmp_path)
    op = start_operator(kubeconfig, namespace, tmp_path)
    try:
        create_job(kube, namespace, "denied", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))

        def denied() -> dict[str, Any] | None:
            conds = {c["type"]: c for c in get_job(kube, namespace, "denied").get("status", {}).get("conditions") or []}
            ready, degraded = conds.get(contract.COND_READY, {}), conds.get(contract.COND_DEGRADED, {})
            if ready.get("reason") == "PermissionDenied" and degraded.get("status") == "True":
                return ready
            return None

        ready = wait_until(denied, timeout=60, what="Ready=False reason PermissionDenied")
        assert ready["status"] == "False"
        assert 'cannot create resource "pods"' in ready["message"], ready["message"]
        assert "rbac.create" in ready["message"]  # says how to fix it
        wait_until(lambda: _events(kube, namespace, "PermissionDenied"), what="a PermissionDenied Warning Event")
        assert _events(kube, namespace, "PermissionDenied")[0].type == "Warning"
        wait_until(lambda: "permission denied job=" in op.log(), what="an error line in the operator log")
        assert not live_pods(kube, namespace, "denied")  # every pod is dry-run before any is created
        assert op.alive()

        # Give the permission back: the retries (backoff) pick it up, no restart needed.
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([d for d in rbac if d["kind"] == "Role"]))
        wait_until(lambda: len(live_pods(kube, namespace, "denied")) == 2, timeout=90, what="pods once permitted")
        wait_until(lambda: not denied(), timeout=60, what="the PermissionDenied condition cleared")
    finally:
        op.stop()
        for p in kube.core.list_namespaced_pod(namespace).items:
            kube.core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)


def test_a_missing_status_permission_fails_loudly(cluster: Any, kube: Any, namespace: str, wsj_crd: str,
                                                  op_nodes: list[str], tmp_path: Path) -> None:
    """Without `patch weightsyncjobs/status` the job's status can't carry the problem: the Event and the
    operator's error log must (never a silent job with no status)."""
    rbac = without_verb(rendered_rbac(namespace), "weightsyncjobs/status", "patch")
    kubeconfig = operator_kubeconfig(cluster, namespace, rbac, tmp_path)
    op = start_operator(kubeconfig, namespace, tmp_path)
    try:
        create_job(kube, namespace, "nostatus", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
        events = wait_until(lambda: _events(kube, namespace, "PermissionDenied"), timeout=60, what="a PermissionDenied Event")
        assert 'cannot patch resource "weightsyncjobs/status"' in events[0].message, events[0].message
        wait_until(lambda: "cannot write the job's status" in op.log(), what="the error line in the operator log")
        log = op.log()
        assert "permission denied job=" in log and "weightsyncjobs/status" in log
        assert not get_job(kube, namespace, "nostatus").get("status")  # nothing could be written ...
        time.sleep(3)  # ... and the retries (backoff) do not post an Event each
        assert len(_events(kube, namespace, "PermissionDenied")) == 1
        assert op.alive()
    finally:
        op.stop()
        for p in kube.core.list_namespaced_pod(namespace).items:
            kube.core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)
