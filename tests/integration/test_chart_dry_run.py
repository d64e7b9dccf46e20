"""The chart is clean: `helm lint` (also --strict) and `helm template ... | kubectl apply --dry-run=server -f -`
against the local control plane for the main value combinations (the API server validates every rendered
object: schemas, RBAC rules, the hook Job's pod spec, the monitoring objects against their CRDs)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.e2e.binaries import find_binary
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[2] / "helm" / "weightsync-operator"
KUBE_VERSION = "1.34.4"
# kubectl's client-side apply says this about objects it did not create (the shared WeightSyncJob CRD,
# installed by the session's fixture with server-side apply): informational, not an error.
BENIGN_WARNING = "missing the kubectl.kubernetes.io/last-applied-configuration annotation"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(find_binary("helm")), *args], capture_output=True, text=True, timeout=120)


def _set_args(sets: tuple[str, ...]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("sets", [(), ("crds.upgradeHook.enabled=true", "metrics.serviceMonitor.enabled=true",
                                       "prometheusRule.enabled=true", "replicaCount=2",
                                       "agentMetrics.podMonitor.enabled=true")])
def test_helm_lint(strict: bool, sets: tuple[str, ...]) -> None:
    r = helm("lint", str(CHART), "--kube-version", KUBE_VERSION, *(["--strict"] if strict else []), *_set_args(sets))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout
    assert "[ERROR]" not in r.stdout and "[WARNING]" not in r.stdout, r.stdout


def _monitoring_crd(kind: str, plural: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


@pytest.fixture
def monitoring_crds(cluster: Any) -> Iterator[None]:
    """Minimal ServiceMonitor, PodMonitor and PrometheusRule CRDs (the Prometheus Operator is not installed
    here); deleted afterwards unless they were there before."""
    crds = [_monitoring_crd("ServiceMonitor", "servicemonitors"), _monitoring_crd("PodMonitor", "podmonitors"),
            _monitoring_crd("PrometheusRule", "prometheusrules")]
    existed = {c["metadata"]["name"] for c in crds
               if cluster.kubectl("get", f"crd/{c['metadata']['name']}", check=False).returncode == 0}
    created = [c for c in crds if c["metadata"]["name"] not in existed]
    if created:
        cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(created))
    for c in crds:
        wait_until(lambda c=c: cluster.kubectl("get", f"crd/{c['metadata']['name']}", "-o",
                                               "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                                               check=False).stdout.strip() == "True",
                   timeout=60, what=f"{c['metadata']['name']} Established")
        # Discovery must know the new kinds before kubectl can map them.
        wait_until(lambda c=c: cluster.kubectl("get", c["spec"]["names"]["plural"], "-A", check=False).returncode == 0,
                   timeout=60, what=f"{c['spec']['names']['plural']} served")
    try:
        yield
    finally:
        for c in created:
            cluster.kubectl("delete", f"crd/{c['metadata']['name']}", "--ignore-not-found", "--wait=false", check=False)


def _dry_run(cluster: Any, namespace: str, *sets: str, include_crds: bool = False) -> list[dict[str, Any]]:
    """`helm template ... | kubectl apply --dry-run=server -f -`; returns the rendered objects after checking
    the API server accepted every one of them without an error or a warning."""
    r = helm("template", "ws", str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION,
             *(["--include-crds"] if include_crds else []), *_set_args(sets))
    assert r.returncode == 0, r.stderr
    objs = [d for d in yaml.safe_load_all(r.stdout) if d]
    # server-side: the CRD (full pod template schema) is too big for client-side apply's last-applied annotation
    applied = cluster.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=r.stdout, check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    bad = [line for line in applied.stderr.splitlines() if line.strip() and BENIGN_WARNING not in line]
    assert not bad, applied.stderr
    lines = [line for line in applied.stdout.splitlines() if line.strip()]
    assert len(lines) == len(objs) and all(line.endswith("(server dry run)") for line in lines), applied.stdout
    # Nothing was created for real.
    assert cluster.kubectl("get", "deploy", "-n", namespace, "-o", "name").stdout.strip() == ""
    return objs


def test_default_cluster_wide_install_with_crds(cluster: Any, namespace: str, wsj_crd: str) -> None:
    objs = _dry_run(cluster, namespace, include_crds=True)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "Secret", "Service",
                     "ServiceAccount", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy",
                     "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding"]


def test_namespaced_install(cluster: Any, namespace: str, wsj_crd: str) -> None:
    objs = _dry_run(cluster, namespace, f"watchNamespaces={{{namespace}}}")
    assert {o["kind"] for o in objs} == {"Role", "RoleBinding", "Deployment", "Secret", "Service", "ServiceAccount",
                                         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def test_two_replicas_with_peering(cluster: Any, namespace: str, wsj_crd: str) -> None:
    objs = _dry_run(cluster, namespace, "replicaCount=2")
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "CustomResourceDefinition"} == {
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def test_crd_upgrade_hook_enabled(cluster: Any, namespace: str, wsj_crd: str) -> None:
    objs = _dry_run(cluster, namespace, "crds.upgradeHook.enabled=true",
                    "cluster.draDeviceClassName=gpu.nvidia.com", "cluster.rdmaResourceName=example.com/roce")
    hook = [o for o in objs if o["metadata"]["labels"]["app.kubernetes.io/component"] == "crd-upgrade"]
    assert sorted(o["kind"] for o in hook) == ["ClusterRole", "ClusterRoleBinding", "Job", "ServiceAccount"]


def test_service_monitor_pod_monitor_and_prometheus_rule(cluster: Any, namespace: str, wsj_crd: str,
                                                        monitoring_crds: None) -> None:
    objs = _dry_run(cluster, namespace, "metrics.serviceMonitor.enabled=true", "prometheusRule.enabled=true",
                    "prometheusRule.additionalLabels.release=kube-prometheus-stack",
                    "agentMetrics.podMonitor.enabled=true",
                    "agentMetrics.allowFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring")
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= {o["kind"] for o in objs}
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM"] == (
        '[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]')


@pytest.mark.parametrize("hook", [False, True])
def test_notes_tell_how_crds_are_upgraded(cluster: Any, namespace: str, wsj_crd: str, hook: bool) -> None:
    r = helm("install", "ws", str(CHART), "-n", namespace, "--kubeconfig", str(cluster.kubeconfig),
             "--dry-run=server", "--set", f"crds.upgradeHook.enabled={str(hook).lower()}",
             "--set", f"watchNamespaces={{{namespace}}}")
    assert r.returncode == 0, r.stdout + r.stderr
    notes = r.stdout.split("NOTES:", 1)[1]
    if hook:
        assert "pre-upgrade hook Job (ws-weightsync-operator-crd-upgrade)" in notes
    else:
        assert "kubectl apply --server-side --force-conflicts -f crds/" in notes
        assert "crds.upgradeHook.enabled=true" in notes
