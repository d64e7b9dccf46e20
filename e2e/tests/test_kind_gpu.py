"""Only on a kind cluster with GPU nodes (E2E_CLUSTER=kind; e2e/kind/ creates it, loads the images and
installs the chart): the GPU nodes advertise nvidia.com/gpu with the labels the operator selects on, the
chart's operator runs the image `make image` built, and a demo job asking for GPUs is placed on the GPU
nodes by that in-cluster operator, with the injected agent sidecar, and serves its versions bit-exact.

Skipped (with the reason) everywhere else; `make test` deselects the `kind` marker. Only
test_gpu_demo_manifest_asks_for_gpu_nodes (no cluster: the manifest the kind test applies is valid and
the operator's builders give its pods GPUs and the GPU node affinity) runs in CI.
Settings (e2e/kind/install.sh uses the same defaults):
  WEIGHTSYNC_KIND_RELEASE_NAMESPACE  the chart's namespace (default weightsync-system)
  WEIGHTSYNC_KIND_JOB_NAMESPACE      a namespace the chart's operator watches (default weightsync-kind)
  WEIGHTSYNC_KIND_IMAGE_TAG          the image tag loaded into kind (default: the chart's appVersion)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from weightsync.crds import contract
from weightsync.crds.models import WeightSyncJobSpec
from weightsync.e2e import demo
from weightsync.e2e.pytest_plugin import Kube
from weightsync.operator.common import JobRef
from weightsync.operator.config import OperatorConfig
from weightsync.operator.placement import Plan, plan
from weightsync.operator.pods import build_pods

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "weightsync-operator"
RELEASE_NAMESPACE = os.environ.get("WEIGHTSYNC_KIND_RELEASE_NAMESPACE", "weightsync-system")
JOB_NAMESPACE = os.environ.get("WEIGHTSYNC_KIND_JOB_NAMESPACE", "weightsync-kind")


def image_tag() -> str:
    return os.environ.get("WEIGHTSYNC_KIND_IMAGE_TAG") or str(
        yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def gpu_nodes(kube: Kube) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in kube.core.list_node().items:
        # the client types every field Optional; the API server always sets these on a Node
        assert n.metadata is not None and n.metadata.name and n.status is not None, n
        if int((n.status.allocatable or {}).get(contract.RESOURCE_GPU, "0") or 0) > 0:
            out[n.metadata.name] = n
    return out


def gpu_demo_job(name: str, tag: str) -> dict[str, Any]:
    """examples/demo-separated.yaml on GPUs: 1 trainer pod and 1 engine replica with 1 GPU each, the
    agent image loaded into kind (never pulled), 3 versions."""
    body = demo.load_example("separated", process_nodes=False, name_override=name)
    demo.set_trainer_args(body, versions=3, interval=2)
    body["spec"]["trainer"]["gpusPerPod"] = 1
    body["spec"]["inference"]["gpusPerReplica"] = 1
    body["spec"]["inference"]["replicas"] = 1
    for role in ("trainer", "inference"):
        for c in body["spec"][role]["template"]["spec"]["containers"]:
            c["image"] = f"ghcr.io/weightsync/weightsync-agent:{tag}"
            c["imagePullPolicy"] = "Never"
    return body


def test_gpu_demo_manifest_asks_for_gpu_nodes() -> None:
    """Runs everywhere (no cluster): what the kind test applies is a valid job whose pods need 1 GPU each
    on nodes labelled nvidia.com/gpu.present=true (the labels e2e/kind/create-cluster.sh sets)."""
    body = gpu_demo_job("kind-gpu-check", image_tag())
    spec = WeightSyncJobSpec.model_validate(body["spec"])
    cfg = OperatorConfig()
    p = plan("kind-gpu-check", spec, cfg.node_gpu_count, cfg.rdma_available)
    assert isinstance(p, Plan), p
    pods = build_pods(JobRef(name="kind-gpu-check", namespace="ns", uid="u"), spec, p, cfg)
    assert len(pods) == 2
    for pod in pods:
        pspec = pod["spec"]
        assert "nodeSelector" not in pspec  # the process-node selector is gone: real kubelets run it
        assert pspec["containers"][0]["resources"]["limits"][contract.RESOURCE_GPU] == "1"
        terms = pspec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in terms[0]["matchExpressions"]
        images = {c["image"] for c in pspec["containers"] + pspec["initContainers"]}
        assert images == {f"ghcr.io/weightsync/weightsync-agent:{image_tag()}"}


@pytest.mark.kind
def test_gpu_nodes_advertise_gpus_and_our_labels(kube: Kube) -> None:
    nodes = gpu_nodes(kube)
    assert nodes, ("no node advertises nvidia.com/gpu: is the NVIDIA device plugin running? "
                   "(kubectl -n nvidia-device-plugin get pods; e2e/kind/README.md, troubleshooting)")
    for name, node in nodes.items():
        labels = node.metadata.labels or {}
        assert labels.get("nvidia.com/gpu.present") == "true", f"{name}: label nvidia.com/gpu.present=true missing"
        assert labels.get(contract.LABEL_RACK), f"{name}: label {contract.LABEL_RACK} missing"
        assert not node.spec.unschedulable, f"{name} is cordoned"


@pytest.mark.kind
def test_chart_operator_runs_the_loaded_image(kube: Kube) -> None:
    deployments = kube.apps.list_namespaced_deployment(
        RELEASE_NAMESPACE, label_selector="app.kubernetes.io/name=weightsync-operator").items
    assert deployments, f"no weightsync-operator Deployment in {RELEASE_NAMESPACE}: run e2e/kind/install.sh"
    (dep,) = deployments
    # the client types every field Optional; the API server sets these on a Deployment
    assert dep.metadata is not None and dep.status is not None and dep.spec is not None, dep
    assert dep.spec.template.spec is not None, dep
    assert (dep.status.available_replicas or 0) >= 1, f"{dep.metadata.name}: not available"
    (container,) = dep.spec.template.spec.containers
    assert container.image == f"ghcr.io/weightsync/weightsync-operator:{image_tag()}"
    assert container.command == ["weightsync-operator"]
    env = {e.name: e.value for e in container.env or []}
    assert env["WEIGHTSYNC_AGENT_IMAGE"] == f"ghcr.io/weightsync/weightsync-agent:{image_tag()}"


@pytest.mark.kind
def test_gpu_demo_job_lands_on_gpu_nodes_and_serves_bit_exact(cluster: Any, kube: Kube, process_runtime: Any) -> None:
    nodes = gpu_nodes(kube)
    free = sum(int(n.status.allocatable[contract.RESOURCE_GPU]) for n in nodes.values())
    assert free >= 2, f"the demo needs 2 GPUs (1 trainer + 1 engine); the GPU nodes have {free}"
    try:
        kube.core.read_namespace(JOB_NAMESPACE)
    except ApiException as exc:
        pytest.fail(f"namespace {JOB_NAMESPACE} missing ({exc.status}): e2e/kind/install.sh creates it")
    name = f"kind-gpu-{secrets.token_hex(2)}"
    body = gpu_demo_job(name, image_tag())
    demo.apply(cluster, body, JOB_NAMESPACE)
    try:
        with cluster.api_client() as api:
            custom = kubernetes.client.CustomObjectsApi(api)
            demo.wait_served(custom, JOB_NAMESPACE, name, 3, timeout=600,
                             diagnose=lambda: demo.log_tails(cluster, JOB_NAMESPACE, demo.job_pods(api, JOB_NAMESPACE, name)))
            pods = demo.job_pods(api, JOB_NAMESPACE, name)
        assert len(pods) == 2, sorted(pods)
        for pod_name, pod in pods.items():
            spec = pod["spec"]
            assert spec["nodeName"] in nodes, f"{pod_name} runs on {spec['nodeName']}, not a GPU node {sorted(nodes)}"
            app = spec["containers"][0]
            assert app["resources"]["limits"][contract.RESOURCE_GPU] == "1", app["resources"]
            agent = next(c for c in spec["initContainers"] if c["name"] == contract.AGENT_CONTAINER)
            assert agent["image"] == f"ghcr.io/weightsync/weightsync-agent:{image_tag()}"
            assert agent["command"] == ["weightsync-agent"]
        report = demo.verify_bit_exact(pods, 3)
        assert report.ok, report
    finally:
        cluster.kubectl("delete", "wsj", name, "-n", JOB_NAMESPACE, "--wait=false", check=False)
