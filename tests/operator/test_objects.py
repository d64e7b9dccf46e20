"""Builders of the supporting objects: Service, Secret, RBAC, NetworkPolicy, DRA template."""

from __future__ import annotations

import base64

from weightsync.crds import contract
from weightsync.operator.config import OperatorConfig
from weightsync.operator.dra import build_resource_claim_template
from weightsync.operator.networkpolicy import build_network_policy
from weightsync.operator.rbac import build_role, build_role_binding, build_service_account
from weightsync.operator.secret import build_secret, new_token
from weightsync.operator.service import build_routing_service, build_service


def _owned(obj, job):
    (ref,) = obj["metadata"]["ownerReferences"]
    return ref["uid"] == job.uid and ref["controller"] is True and obj["metadata"]["namespace"] == job.namespace


def test_headless_service(job, separated):
    svc = build_service(job, separated())
    assert _owned(svc, job) and svc["metadata"]["name"] == "demo"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {contract.LABEL_JOB: "demo", contract.LABEL_MANAGED_BY: contract.MANAGED_BY}
    assert {p["port"] for p in svc["spec"]["ports"]} == {*contract.AGENT_PORTS, 30000}


def test_routing_service_selects_ready_inference_frontends_only(job, separated, colocated):
    from weightsync.operator.placement import plan
    from weightsync.operator.pods import build_pods

    spec = separated(inference={"replicas": 2, "gpusPerReplica": 16, "podsPerReplica": 2,
                                "parallelism": {"tensor": 16}})
    p = plan("demo", spec)
    svc = build_routing_service(job, spec, p)
    assert _owned(svc, job) and svc["metadata"]["name"] == "demo-inference"
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["ports"] == [{"name": "http", "port": 30000, "targetPort": 30000, "protocol": "TCP"}]
    # the selector matches exactly the first pod of each inference replica, never trainer pods
    sel = svc["spec"]["selector"]
    pods = build_pods(job, spec, p, OperatorConfig(), {})
    chosen = sorted(x["metadata"]["name"] for x in pods if sel.items() <= x["metadata"]["labels"].items())
    assert chosen == ["demo-inference-0-0", "demo-inference-1-0"]
    col = colocated()
    cp = plan("demo", col)
    sel = build_routing_service(job, col, cp)["spec"]["selector"]
    chosen = sorted(x["metadata"]["name"] for x in build_pods(job, col, cp, OperatorConfig(), {})
                    if sel.items() <= x["metadata"]["labels"].items())
    assert chosen == sorted(n for n in cp.names), "every colocated pod serves its replicas"


def test_secret_token_is_random_and_immutable(job):
    a, b = build_secret(job), build_secret(job)
    assert _owned(a, job) and a["metadata"]["name"] == "demo-token" and a["immutable"] is True
    ta = base64.b64decode(a["data"][contract.TOKEN_FILE]).decode()
    tb = base64.b64decode(b["data"][contract.TOKEN_FILE]).decode()
    assert ta != tb and len(ta) == 64 and int(ta, 16) >= 0
    assert len(new_token()) == 64


def test_role_is_scoped_by_resource_names(job):
    role = build_role(job, ["demo-trainer-1", "demo-trainer-0", "demo-trainer-0"])
    assert _owned(role, job) and role["metadata"]["name"] == "demo-agent"
    by_res = {tuple(r["resources"]): r for r in role["rules"]}
    assert by_res[("pods",)]["resourceNames"] == ["demo-trainer-0", "demo-trainer-1"]
    assert set(by_res[("pods",)]["verbs"]) == {"get", "list", "watch", "patch"}
    assert by_res[("pods/status",)]["verbs"] == ["get", "patch"]
    assert by_res[("configmaps",)]["resourceNames"] == ["demo-topology", "demo-desired"]
    assert "patch" not in by_res[("configmaps",)]["verbs"]
    assert all(r["resourceNames"] for r in role["rules"])  # nothing unscoped
    assert not any("secrets" in r["resources"] for r in role["rules"])


def test_role_binding_and_service_account(job):
    sa = build_service_account(job)
    rb = build_role_binding(job)
    assert sa["metadata"]["name"] == "demo-agent" and _owned(sa, job)
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo-agent"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "demo-agent", "namespace": "ns1"}]


def test_network_policy_closes_agent_ports_to_outsiders(job):
    np = build_network_policy(job)
    spec = np["spec"]
    sel = {contract.LABEL_JOB: "demo", contract.LABEL_MANAGED_BY: contract.MANAGED_BY}
    assert spec["podSelector"]["matchLabels"] == sel and spec["policyTypes"] == ["Ingress"]
    from_job, from_any = spec["ingress"]
    assert from_job == {"from": [{"podSelector": {"matchLabels": sel}}]}
    assert "from" not in from_any
    # No open range from anywhere covers an agent port; everything else is open.
    for port in contract.AGENT_PORTS:
        assert not any(r["port"] <= port <= r["endPort"] for r in from_any["ports"])
    tcp = sorted((r["port"], r["endPort"]) for r in from_any["ports"] if r["protocol"] == "TCP")
    assert tcp == [(1, min(contract.AGENT_PORTS) - 1), (max(contract.AGENT_PORTS) + 1, 65535)]


def test_network_policy_has_no_metrics_rule_unless_configured(job):
    assert build_network_policy(job) == build_network_policy(job, ())
    assert len(build_network_policy(job)["spec"]["ingress"]) == 2
    assert all("ports" not in r or all(p.get("port") != contract.METRICS_PORT for p in r["ports"])
               for r in build_network_policy(job)["spec"]["ingress"])


def test_network_policy_admits_configured_peers_to_the_metrics_port_only(job):
    peers = ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
             {"namespaceSelector": {"matchLabels": {"team": "obs"}}})
    np = build_network_policy(job, peers)
    base = build_network_policy(job)
    from_job, from_any, metrics = np["spec"]["ingress"]
    assert [from_job, from_any] == base["spec"]["ingress"]  # the job-internal rules are unchanged
    assert metrics == {"from": list(peers), "ports": [{"protocol": "TCP", "port": contract.METRICS_PORT}]}
    assert "endPort" not in metrics["ports"][0]
    for port in set(contract.AGENT_PORTS) - {contract.METRICS_PORT}:
        for rule in (from_any, metrics):
            assert not any(r["port"] <= port <= r.get("endPort", r["port"]) for r in rule["ports"])
    # The policy holds copies: later edits of the config's peers do not leak into a built object.
    metrics["from"][0]["podSelector"]["matchLabels"]["x"] = "y"
    assert "x" not in peers[0]["podSelector"]["matchLabels"]


def test_dra_template_only_for_colocated_with_dra(job, colocated, separated):
    assert build_resource_claim_template(job, colocated()) is None
    assert build_resource_claim_template(job, separated()) is None
    spec = colocated(
        placement={"mode": "Colocated", "dra": {"deviceClassName": "gpu.example.com"}},
        trainer={"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 1, "pipeline": 1, "data": 8}},
        inference={"replicas": 4, "gpusPerReplica": 2},
    )
    rct = build_resource_claim_template(job, spec)
    assert rct is not None and rct["apiVersion"] == "resource.k8s.io/v1" and _owned(rct, job)
    (req,) = rct["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"] == {"deviceClassName": "gpu.example.com", "allocationMode": "ExactCount", "count": 4}
    # The spec's DeviceClass wins over the operator's default.
    rct = build_resource_claim_template(job, spec, OperatorConfig(dra_device_class_name="other.example.com"))
    assert rct is not None and rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == (
        "gpu.example.com")


def test_dra_template_without_a_class_in_the_spec_uses_the_operators_default(job, colocated):
    spec = colocated(
        placement={"mode": "Colocated", "dra": {}},
        trainer={"replicas": 2, "gpusPerPod": 4, "parallelism": {"tensor": 1, "pipeline": 1, "data": 8}},
        inference={"replicas": 4, "gpusPerReplica": 2},
    )
    rct = build_resource_claim_template(job, spec, OperatorConfig(dra_device_class_name="gpu.nvidia.com"))
    assert rct is not None
    assert rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    # Neither set: no template (the planner refuses the job with DRADeviceClassMissing).
    assert build_resource_claim_template(job, spec, OperatorConfig()) is None
