"""The Helm chart renders for both scopes, RBAC is least-privilege and the values schema refuses typos.
Uses the project's helm binary (e2e/scripts/build-binaries.sh); no cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from weightsync.crds import contract
from weightsync.crds.models import DEFAULT_RDMA_RESOURCE
from weightsync.e2e.binaries import BinaryNotFound, find_binary
from weightsync.operator import metrics as operator_metrics
from weightsync.operator.config import OperatorConfig
from weightsync.operator.placement import plan
from weightsync.operator.pods import build_pods

CHART = Path(__file__).resolve().parents[2] / "helm" / "weightsync-operator"


@pytest.fixture(scope="module")
def helm() -> Path:
    try:
        return find_binary("helm")
    except BinaryNotFound as err:
        pytest.skip(f"helm binary not built: {err}")


def render(helm: Path, *sets: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`--set k=v` for each of sets; `json:k=<json>` goes as `--set-json k=<json>`."""
    args = [str(helm), "template", "ws", str(CHART), "-n", "ops", "--kube-version", "1.34.4"]
    for s in sets:
        args += ["--set-json", s.removeprefix("json:")] if s.startswith("json:") else ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, check=check)


def docs(helm: Path, *sets: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(helm, *sets).stdout) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_lint(helm):
    r = subprocess.run([str(helm), "lint", str(CHART), "--kube-version", "1.34.4"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_renders_without_kube_version(helm):
    """`helm template` with Helm's default capabilities (no --kube-version, no cluster) must render."""
    r = subprocess.run([str(helm), "template", "ws", str(CHART)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "kind: Deployment" in r.stdout


def test_cluster_wide_install(helm):
    objs = docs(helm)
    assert sorted({o["kind"] for o in objs}) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Secret",
                                                 "Service", "ServiceAccount", "ValidatingAdmissionPolicy",
                                                 "ValidatingAdmissionPolicyBinding"]
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


# --- CRD upgrade hook, cluster defaults, PrometheusRule, labels --------------------------------------------
HOOK_ANNOTATIONS = ("helm.sh/hook", "helm.sh/hook-weight", "helm.sh/hook-delete-policy")
STANDARD_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                   "app.kubernetes.io/managed-by", "app.kubernetes.io/component", "app.kubernetes.io/part-of",
                   "helm.sh/chart")


def test_crd_upgrade_hook_is_off_by_default(helm):
    objs = docs(helm)
    assert not by_kind(objs, "Job")
    assert not [o for o in objs if any(a in (o["metadata"].get("annotations") or {}) for a in HOOK_ANNOTATIONS)]


def test_crd_upgrade_hook_objects_order_and_least_privilege(helm):
    objs = [o for o in docs(helm, "crds.upgradeHook.enabled=true")
            if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "crd-upgrade"]
    assert sorted(o["kind"] for o in objs) == ["ClusterRole", "ClusterRoleBinding", "Job", "ServiceAccount"]
    name = "ws-weightsync-operator-crd-upgrade"
    assert {o["metadata"]["name"] for o in objs} == {name}
    weights = {}
    for o in objs:
        ann = o["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "pre-upgrade"
        assert set(ann["helm.sh/hook-delete-policy"].split(",")) == {"before-hook-creation", "hook-succeeded"}
        weights[o["kind"]] = int(ann["helm.sh/hook-weight"])
    # Helm creates hooks in weight order: the identity and its permissions exist before the Job starts.
    assert max(weights[k] for k in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")) < weights["Job"]

    (role,) = by_kind(objs, "ClusterRole")
    assert role["rules"] == [{
        "apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
        "resourceNames": [contract.CRD_NAME], "verbs": ["get", "create", "patch", "update"],
    }]
    (binding,) = by_kind(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == name
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "ops"}]

    (job,) = by_kind(objs, "Job")
    assert job["metadata"]["namespace"] == "ops"
    assert job["spec"]["backoffLimit"] == 2 and job["spec"]["activeDeadlineSeconds"] == 300
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"] is True
    assert pod["restartPolicy"] == "Never"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/weightsync/weightsync-operator:0.1.0"  # the operator image
    assert c["command"][:2] == ["weightsync-crds", "apply"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The Job's pod is not selected by the operator Deployment or the metrics Service.
    (dep,) = by_kind(docs(helm, "crds.upgradeHook.enabled=true"), "Deployment")
    selector = dep["spec"]["selector"]["matchLabels"]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= pod_labels.items()


def test_crd_upgrade_hook_values(helm):
    (job,) = by_kind(docs(helm, "crds.upgradeHook.enabled=true", "crds.upgradeHook.backoffLimit=5",
                          "crds.upgradeHook.activeDeadlineSeconds=120", "image.tag=9.9.9"), "Job")
    assert (job["spec"]["backoffLimit"], job["spec"]["activeDeadlineSeconds"]) == (5, 120)
    assert job["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":9.9.9")


def _operator_env(objs: list[dict[str, Any]]) -> dict[str, str]:
    """The operator's env as rendered, minus the key file (a mounted Secret that exists only in the pod)."""
    (dep,) = by_kind(objs, "Deployment")
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e and e["name"] != "WEIGHTSYNC_OPERATOR_KEY_FILE"}


def test_cluster_rdma_resource_and_dra_device_class_reach_the_operator_config(helm):
    env = _operator_env(docs(helm))
    assert env["WEIGHTSYNC_RDMA_RESOURCE"] == DEFAULT_RDMA_RESOURCE and env["WEIGHTSYNC_DRA_DEVICE_CLASS"] == ""
    cfg = OperatorConfig.from_env(env)
    assert (cfg.rdma_resource_name, cfg.dra_device_class_name) == (DEFAULT_RDMA_RESOURCE, "")
    env = _operator_env(docs(helm, "cluster.rdmaResourceName=example.com/roce",
                             "cluster.draDeviceClassName=gpu.nvidia.com"))
    cfg = OperatorConfig.from_env(env)
    assert (cfg.rdma_resource_name, cfg.dra_device_class_name) == ("example.com/roce", "gpu.nvidia.com")


def test_prometheus_rule_is_opt_in_with_the_documented_alerts(helm):
    assert not by_kind(docs(helm), "PrometheusRule")
    objs = docs(helm, "prometheusRule.enabled=true", "prometheusRule.versionLagThreshold=3",
                "prometheusRule.additionalLabels.release=kps")
    (rule,) = by_kind(objs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert sorted(rules) == ["WeightSyncDigestMismatch", "WeightSyncJobVersionLag", "WeightSyncOperatorDown",
                             "WeightSyncOperatorReconcileErrors",
                             "WeightSyncReplicaStale", "WeightSyncSyncFailing", "WeightSyncTrainerStalled"]
    lag, errors, down = (rules[n] for n in ("WeightSyncJobVersionLag", "WeightSyncOperatorReconcileErrors",
                                            "WeightSyncOperatorDown"))
    assert lag["expr"] == "weightsync_job_version_lag > 3" and lag["for"] == "10m"
    assert errors["expr"] == "rate(weightsync_operator_reconcile_errors_total[10m]) > 0" and errors["for"] == "15m"
    (svc,) = by_kind(objs, "Service")  # the scrape job Prometheus names after the metrics Service
    assert down["expr"] == f'absent(up{{job="{svc["metadata"]["name"]}",namespace="ops"}} == 1)' and down["for"] == "5m"
    assert [r["labels"]["severity"] for r in (lag, errors, down)] == ["warning", "warning", "critical"]
    for r in rules.values():
        ann = r["annotations"]
        assert ann["summary"] and ann["description"]
        assert ann["runbook_url"].endswith("docs/operations.md#troubleshooting")
    # The metrics the alerts read are the ones the operator exports.
    exported = {f.name for m in vars(operator_metrics).values() if isinstance(m, MetricWrapperBase)
                for f in m.describe()}
    assert {"weightsync_job_version_lag", "weightsync_operator_reconcile_errors", "weightsync_job_degraded",
            "weightsync_job_trainer_version"} <= exported


def test_prometheus_rule_needs_the_metrics_service(helm):
    r = render(helm, "prometheusRule.enabled=true", "metrics.service.enabled=false", check=False)
    assert r.returncode != 0 and "metrics.service.enabled" in r.stderr


@pytest.mark.parametrize("sets", [
    (),
    ("watchNamespaces={team-a,team-b}",),
    ("replicaCount=2", "crds.upgradeHook.enabled=true", "metrics.serviceMonitor.enabled=true",
     "prometheusRule.enabled=true", "agentMetrics.podMonitor.enabled=true"),
])
def test_every_object_has_the_standard_labels(helm, sets):
    objs = docs(helm, *sets)
    assert len(objs) >= 5
    for o in objs:
        labels = o["metadata"].get("labels") or {}
        missing = [k for k in STANDARD_LABELS if not labels.get(k)]
        assert not missing, f"{o['kind']}/{o['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/instance"] == "ws"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["app.kubernetes.io/component"] in ("operator", "crd-upgrade")
    if sets:
        assert {o["kind"] for o in objs} >= ({"Role"} if "watch" in sets[0] else {"Job", "PrometheusRule",
                                                                                  "ServiceMonitor", "PodMonitor"})


@pytest.mark.parametrize("bad", ["crds.upgradeHook.enabled=maybe", "crds.upgradeHook.typo=1", "crds.typo=1",
                                 "crds.upgradeHook.backoffLimit=-1", "crds.upgradeHook.activeDeadlineSeconds=5",
                                 "prometheusRule.enabled=yes", "prometheusRule.versionLagThreshold=-1",
                                 "prometheusRule.typo=1", "prometheusRule.additionalLabels.a=null",
                                 "cluster.rdmaResourceName=not a resource", "cluster.rdmaResourceName=",
                                 "cluster.draDeviceClassName=Bad_Class"])
def test_values_schema_refuses_bad_new_values(helm, bad):
    r = render(helm, bad, check=False)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, (bad, r.stderr)


# --- agent metrics: NetworkPolicy peers and the PodMonitor -------------------------------------------------
PROMETHEUS_PEERS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
                    {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["obs"]}]}}]


def test_agent_metrics_allow_from_reaches_the_operator_config(helm):
    env = _operator_env(docs(helm))
    assert env["WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM"] == "[]"
    assert OperatorConfig.from_env(env).agent_metrics_allow_from == ()
    env = _operator_env(docs(helm, f"json:agentMetrics.allowFrom={json.dumps(PROMETHEUS_PEERS)}"))
    assert OperatorConfig.from_env(env).agent_metrics_allow_from == tuple(PROMETHEUS_PEERS)


def test_agent_pod_monitor_is_opt_in_and_selects_the_agents(helm, job, separated, cfg):
    assert not by_kind(docs(helm), "PodMonitor")
    (pm,) = by_kind(docs(helm, "agentMetrics.podMonitor.enabled=true", "agentMetrics.podMonitor.interval=15s",
                         "agentMetrics.podMonitor.additionalLabels.release=kps"), "PodMonitor")
    assert pm["metadata"]["namespace"] == "ops" and pm["metadata"]["labels"]["release"] == "kps"
    spec = pm["spec"]
    assert spec["selector"] == {"matchLabels": {contract.LABEL_MANAGED_BY: contract.MANAGED_BY}}
    assert spec["namespaceSelector"] == {"any": True}  # cluster-wide install
    assert spec["podTargetLabels"] == [contract.LABEL_JOB, contract.LABEL_ROLE]
    (ep,) = spec["podMetricsEndpoints"]
    assert (ep["path"], ep["interval"]) == ("/metrics", "15s")
    # Every pod the operator builds matches the selector, and its agent sidecar names the metrics port so.
    spec_ = separated()
    pods = build_pods(job, spec_, plan(job.name, spec_, cfg.node_gpu_count, cfg.rdma_available,
                                       cfg.dra_device_class_name), cfg)
    assert pods
    for p in pods:
        assert spec["selector"]["matchLabels"].items() <= p["metadata"]["labels"].items()
        (agent,) = [c for c in p["spec"]["initContainers"] if c["name"] == contract.AGENT_CONTAINER]
        assert {"name": ep["port"], "containerPort": contract.METRICS_PORT, "protocol": "TCP"} in agent["ports"]
    (pm,) = by_kind(docs(helm, "agentMetrics.podMonitor.enabled=true", "watchNamespaces={team-a,team-b}"),
                    "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


@pytest.mark.parametrize("bad", [
    'json:agentMetrics.allowFrom=[{}]',
    'json:agentMetrics.allowFrom=[{"ipBlock": {"cidr": "0.0.0.0/0"}}]',
    'json:agentMetrics.allowFrom=[{"podSelector": {"app": "prometheus"}}]',
    'json:agentMetrics.allowFrom=[{"podSelector": {"matchLabels": {"app": 1}}}]',
    'json:agentMetrics.allowFrom=[{"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]',
    'json:agentMetrics.allowFrom={"podSelector": {}}',
    "agentMetrics.podMonitor.enabled=yes", "agentMetrics.podMonitor.interval=30", "agentMetrics.typo=1",
    "agentMetrics.podMonitor.typo=1",
])
def test_values_schema_refuses_bad_agent_metrics_values(helm, bad):
    r = render(helm, bad, check=False)
    assert r.returncode != 0 and "values don't meet the specifications of the schema" in r.stderr, (bad, r.stderr)


def _policies(objs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each ValidatingAdmissionPolicy by name, with its binding."""
    bindings = {b["spec"]["policyName"]: b for b in by_kind(objs, "ValidatingAdmissionPolicyBinding")}
    return {p["metadata"]["name"]: (p, bindings[p["metadata"]["name"]]) for p in by_kind(objs, "ValidatingAdmissionPolicy")}


def test_template_policy_renders_the_generated_validations(helm):
    from weightsync.crds.template_policy import admission_policy_validations

    pol = _policies(docs(helm))
    host, binding = pol["ws-weightsync-operator-host-access"]
    ports, pbinding = pol["ws-weightsync-operator-agent-ports"]
    assert host["spec"]["validations"] == admission_policy_validations(True)
    assert ports["spec"]["validations"] == admission_policy_validations(False)
    assert host["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == [contract.PLURAL]
    assert host["spec"]["failurePolicy"] == "Fail" and binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"] and "matchResources" not in pbinding["spec"]


def test_template_policy_allowed_namespaces_and_watch_scope(helm):
    objs = docs(helm, "templatePolicy.allowHostAccessNamespaces={infra}", "watchNamespaces={team-a,infra}")
    pol = _policies(objs)
    _, host = pol["ws-weightsync-operator-host-access"]
    _, ports = pol["ws-weightsync-operator-agent-ports"]
    watch = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "infra"]}
    assert host["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [
        watch, {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["infra"]}]
    assert ports["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == [watch]  # never exempt
    (dep,) = by_kind(objs, "Deployment")
    env = _operator_env([dep])
    assert env["WEIGHTSYNC_HOST_ACCESS_NAMESPACES"] == "infra"
    assert OperatorConfig.from_env(env).host_access_namespaces == frozenset({"infra"})


def test_template_policy_can_be_turned_off(helm):
    kinds = {o["kind"] for o in docs(helm, "templatePolicy.enabled=false")}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    bad = render(helm, "templatePolicy.allowHostAccessNamespaces={Not_A_Namespace}", check=False)
    assert bad.returncode != 0 and "allowHostAccessNamespaces" in bad.stderr


def test_operator_key_secret_is_generated_mounted_and_replaceable(helm):
    """The operator key (job tokens are derived from it): a generated Secret, mounted read-only into the
    operator and named by WEIGHTSYNC_OPERATOR_KEY_FILE; operatorKey.existingSecret replaces it."""
    import base64

    objs = docs(helm)
    (key,) = by_kind(objs, "Secret")
    assert key["metadata"]["name"] == "ws-weightsync-operator-key"
    assert len(base64.b64decode(key["data"]["key"])) == 64
    (dep,) = by_kind(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "operator-key")
    assert mount["readOnly"] is True
    assert env["WEIGHTSYNC_OPERATOR_KEY_FILE"] == mount["mountPath"] + "/key"
    vol = next(v for v in pod["volumes"] if v["name"] == "operator-key")
    assert vol["secret"] == {"secretName": "ws-weightsync-operator-key", "defaultMode": 0o400}

    own = docs(helm, "operatorKey.existingSecret=my-key")
    assert not by_kind(own, "Secret")
    (dep,) = by_kind(own, "Deployment")
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "operator-key")
    assert vol["secret"]["secretName"] == "my-key"
