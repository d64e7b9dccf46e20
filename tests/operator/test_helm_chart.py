"""The Helm chart renders for both scopes, RBAC is least-privilege and the values schema refuses typos.
Uses the project's helm binary (e2e/scripts/build-binaries.sh); no cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightsync.e2e.binaries import BinaryNotFound, find_binary

CHART = Path(__file__).resolve().parents[2] / "helm" / "weightsync-operator"


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return find_binary("helm")
    except BinaryNotFound as err:
        pytest.skip(f"helm binary not built: {err}")


def render(helm: Path, *sets: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    args = [str(helm), "template", "ws", str(CHART), "-n", "ops", "--kube-version", "1.34.4"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, check=check)


def docs(helm: Path, *sets: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(helm, *sets).stdout) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_lint(helm):
    r = subprocess.run([str(helm), "lint", str(CHART), "--kube-version", "1.34.4"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cluster_wide_install(helm):
    objs = docs(helm)
    assert sorted({o["kind"] for o in objs}) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ServiceAccount"]
    (dep,) = by_kind(objs, "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "--all-namespaces" in c["args"] and not any(a.startswith("--peering") for a in c["args"])
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["WEIGHTSYNC_AGENT_IMAGE"] == "ghcr.io/weightsync/weightsync-agent:0.1.0"
    assert env["WEIGHTSYNC_NODE_GPU_COUNT"] == "8"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    (svc,) = by_kind(objs, "Service")
    assert svc["spec"]["ports"][0]["port"] == 8080
    (binding,) = by_kind(objs, "ClusterRoleBinding")
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": "ws-weightsync-operator", "namespace": "ops"}


def test_namespaced_install_has_no_cluster_scoped_rbac(helm):
    objs = docs(helm, "watchNamespaces={team-a,team-b}")
    kinds = {o["kind"] for o in objs}
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    assert sorted(r["metadata"]["namespace"] for r in by_kind(objs, "Role")) == ["team-a", "team-b"]
    (dep,) = by_kind(objs, "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_rbac_is_least_privilege(helm):
    (role,) = by_kind(docs(helm, "watchNamespaces={team-a}"), "Role")
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert all("*" not in v for v in rules.values())
    assert all("*" not in rule["resources"] and "*" not in rule["apiGroups"] for rule in role["rules"])
    assert rules[("", "secrets")] == {"create"}  # the token is never read back
    assert rules[("weightsync.io", "weightsyncjobs")] == {"get", "list", "watch"}
    assert rules[("weightsync.io", "weightsyncjobs/status")] == {"get", "patch"}
    assert "delete" not in set().union(*(v for (g, r), v in rules.items() if r != "pods"))
    assert not any(r in ("nodes", "namespaces", "customresourcedefinitions") for _, r in rules)


def test_replicas_turn_on_peering(helm):
    objs = docs(helm, "replicaCount=2")
    (dep,) = by_kind(objs, "Deployment")
    assert "--peering=weightsync-operator" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "strategy" not in dep["spec"]
    assert {c["metadata"]["name"] for c in by_kind(objs, "CustomResourceDefinition")} == {
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    (cr,) = by_kind(objs, "ClusterRole")
    assert any("clusterkopfpeerings" in r["resources"] for r in cr["rules"])


def test_service_monitor_is_opt_in(helm):
    assert not by_kind(docs(helm), "ServiceMonitor")
    (sm,) = by_kind(docs(helm, "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"


@pytest.mark.parametrize("bad", ["replicaCount=0", "peering.enabled=maybe", "operator.logFormat=xml",
                                 "cluster.nodeGpuCount=0", "watchNamespaces={Bad_NS}", "typo=1"])
def test_values_schema_refuses_bad_values(helm, bad):
    r = render(helm, bad, check=False)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, r.stderr
