"""The CRD against a real kube-apiserver: examples apply cleanly, the API server fills the same defaults as
the models, `kubectl explain` shows the field docs, status goes through the subresource and the printer
columns show it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_helpers import REPO, kube_json, kubectl_ok

from weightsync.crds import contract
from weightsync.crds.models import (
    LastSync,
    ReplicaCounts,
    WeightSyncJob,
    WeightSyncJobStatus,
    set_condition,
)

pytestmark = pytest.mark.cluster

EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml"))
CORE_EXAMPLES = {"separated-nccl.yaml", "colocated-ipc.yaml", "separated-gdr.yaml"}


def test_core_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= CORE_EXAMPLES


def test_crd_is_established_with_short_name(cluster: Any, crd: str) -> None:
    obj = kube_json(cluster, "get", "crd", crd)
    conds = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
    assert conds["Established"] == "True" and conds["NamesAccepted"] == "True"
    resources = kubectl_ok(cluster, "api-resources", f"--api-group={contract.GROUP}", "-o", "wide")
    assert "wsj" in resources and "WeightSyncJob" in resources and "true" in resources  # namespaced


def _with_port_protocols(spec: dict[str, Any]) -> dict[str, Any]:
    for role in ("trainer", "inference"):
        pod = spec[role]["template"]["spec"]
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            for port in c.get("ports", []):
                port.setdefault("protocol", "TCP")
    return spec


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_applies_cleanly_and_server_defaults_match_models(path: Path, cluster: Any, api_ns: str) -> None:
    result = kubectl_ok(cluster, "apply", "--server-side", "-n", api_ns, "-f", str(path))
    assert "serverside-applied" in result, result
    for doc in yaml.safe_load_all(path.read_text()):
        name = doc["metadata"]["name"]
        stored = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
        # The API server's structural defaulting and the models' defaults agree field by field (templates:
        # plus core/v1's own default of a container port's protocol, which the CRD's template schema has).
        assert stored["spec"] == _with_port_protocols(WeightSyncJob.from_k8s(doc).to_dict()["spec"])
        WeightSyncJob.from_k8s(stored)  # what the operator will read parses
    again = kubectl_ok(cluster, "apply", "--server-side", "-n", api_ns, "-f", str(path))
    assert "serverside-applied" in again  # idempotent, no conflict


def test_examples_create_with_plain_kubectl_create(cluster: Any, api_ns: str) -> None:
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            doc["metadata"]["name"] = doc["metadata"]["name"][:30] + "-c"
            kubectl_ok(cluster, "create", "-n", api_ns, "-f", "-", input=json.dumps(doc))
            kubectl_ok(cluster, "delete", "wsj", doc["metadata"]["name"], "-n", api_ns)


@pytest.mark.parametrize(
    ("resource", "expected"),
    [
        ("wsj.spec.transfer", ["bucketSizeMB", "flattened buckets", "Auto | IPC | NCCL | GDR", "timeoutSeconds",
                               "deltaSync", "rdmaResourceName"]),
        ("wsj.spec.placement", ["topologyKey", "NVLink-domain", "Colocated", "dra"]),
        ("wsj.spec.inference.engine", ["SGLang | VLLM | Custom", "port"]),
        ("wsj.spec.updatePolicy.maxUnavailable", ["percentage", "25%"]),
        ("wsj.status.conditions", ["lastTransitionTime", "observedGeneration", "reason"]),
        ("wsj", ["WeightSyncJob declares trainer pods"]),
    ],
)
def test_kubectl_explain_shows_field_docs(cluster: Any, crd: str, resource: str, expected: list[str]) -> None:
    out = kubectl_ok(cluster, "explain", resource)
    flat = " ".join(out.split())
    for text in expected:
        assert text in flat, f"{text!r} missing from `kubectl explain {resource}`:\n{out}"


def _status_patch() -> dict[str, Any]:
    conds = set_condition([], contract.COND_READY, "True", "AllReplicasReady", "4/4 ready", observed_generation=1)
    conds = set_condition(conds, contract.COND_SYNCED, "False", "Rolling", "3/4 on v7", observed_generation=1)
    status = WeightSyncJobStatus(
        observed_generation=1, mode="NCCL", trainer_version=7, served_version=6, membership_generation=2,
        replicas=ReplicaCounts(inference=4, synced=3, ready=4),
        last_sync=LastSync(version=7, duration_seconds=3.25, bytes=16_384_000_000, mode="NCCL"),
        conditions=conds,
    )
    return status.to_patch()


def test_status_subresource_and_printer_columns(cluster: Any, api_ns: str) -> None:
    path = REPO / "examples" / "separated-nccl.yaml"
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    kubectl_ok(cluster, "apply", "--server-side", "-n", api_ns, "-f", str(path))
    header = kubectl_ok(cluster, "get", "wsj", name, "-n", api_ns).splitlines()[0].split()
    assert header == ["NAME", "PLACEMENT", "MODE", "TRAINER", "SERVED", "SYNCED", "READY", "PAUSED", "DEGRADED", "AGE"]

    patch = _status_patch()
    kubectl_ok(cluster, "patch", "wsj", name, "-n", api_ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps(patch))
    stored = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    assert stored["status"] == patch["status"]  # the status schema keeps every field the model writes
    assert WeightSyncJob.from_k8s(stored).status == WeightSyncJobStatus.model_validate(patch["status"])

    row = kubectl_ok(cluster, "get", "wsj", name, "-n", api_ns, "--no-headers").split()
    assert row[:7] == [name, "Separated", "NCCL", "7", "6", "False", "True"]
    wide = kubectl_ok(cluster, "get", "wsj", name, "-n", api_ns, "-o", "wide").splitlines()
    assert wide[0].split()[-5:] == ["REQUESTED", "REPLICAS", "READY-REPLICAS", "REPLICA-VERSIONS", "COMMITTED"]
    # no replicaVersions / committedVersion in this status: empty columns
    assert wide[1].split()[-3:] == ["NCCL", "2", "4"]


def test_status_cannot_be_written_through_the_main_resource(cluster: Any, api_ns: str) -> None:
    path = REPO / "examples" / "separated-gdr.yaml"
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    kubectl_ok(cluster, "apply", "--server-side", "-n", api_ns, "-f", str(path))
    kubectl_ok(cluster, "patch", "wsj", name, "-n", api_ns, "--type=merge", "-p",
                    json.dumps({"status": {"trainerVersion": 99}, "spec": {"paused": True}}))
    stored = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    assert stored["spec"]["paused"] is True
    assert "trainerVersion" not in stored.get("status", {})


def test_bad_status_is_refused(cluster: Any, api_ns: str) -> None:
    path = REPO / "examples" / "colocated-ipc.yaml"
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    kubectl_ok(cluster, "apply", "--server-side", "-n", api_ns, "-f", str(path))
    bad = {"status": {"conditions": [{"type": "Ready", "status": "Maybe", "reason": "X",
                                      "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    res = cluster.kubectl("patch", "wsj", name, "-n", api_ns, "--subresource=status", "--type=merge",
                          "-p", json.dumps(bad), check=False)
    assert res.returncode != 0
    assert "status.conditions[0].status" in res.stderr and "Unsupported value" in res.stderr
