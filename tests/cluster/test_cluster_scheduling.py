"""The real kube-scheduler places GPU pods on the simulated GPU nodes by their extended resource and labels.

Works against the local control plane and against a GPU kind cluster (WEIGHTSYNC_KUBECONFIG): the GPU
product is read from the nodes, not assumed."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from weightsync.crds import contract
from weightsync.e2e.environment import Environment
from weightsync.e2e.pytest_plugin import Kube, wait_until


def gpu_nodes(kube: Kube, min_gpus: int) -> list[Any]:
    """Ready, untainted nodes with at least MIN_GPUS allocatable GPUs and a product label."""
    found = []
    for node in kube.core.list_node(label_selector=contract.LABEL_GPU_PRODUCT).items:
        gpus = int((node.status.allocatable or {}).get(contract.RESOURCE_GPU, "0"))
        ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
        if gpus >= min_gpus and ready and not node.spec.taints:
            found.append(node)
    return found


def gpu_pod(name: str, gpus: int, affinity: dict[str, Any] | None = None,
            labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "containers": [{
                "name": "main", "image": "weightsync.local/none", "command": ["sleep", "600"],
                "resources": {"limits": {contract.RESOURCE_GPU: str(gpus)}},
            }],
            "affinity": affinity or {},
            "terminationGracePeriodSeconds": 1,
        },
    }


def product_affinity(product: str) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": contract.LABEL_GPU_PRODUCT, "operator": "In", "values": [product]}]}]}}}


def scheduled_node(kube: Kube, namespace: str, name: str) -> str | None:
    return kube.core.read_namespaced_pod(name, namespace).spec.node_name


def unschedulable_message(kube: Kube, namespace: str, name: str) -> str | None:
    """The scheduler's message once it marked the pod PodScheduled=False/Unschedulable."""
    pod = kube.core.read_namespaced_pod(name, namespace)
    for cond in pod.status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            return str(cond.message)
    return None


def force_delete_pods(kube: Kube, namespace: str) -> None:
    """Bound pods on nodes nobody runs would stay Terminating: remove them at once."""
    try:
        kube.core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    except ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def product(cluster: Environment, kube: Kube) -> str:
    nodes = gpu_nodes(kube, 4)
    assert nodes, "no Ready node with >= 4 allocatable nvidia.com/gpu and a gpu.product label"
    return str(nodes[0].metadata.labels[contract.LABEL_GPU_PRODUCT])


def test_pod_asking_4_gpus_lands_on_a_matching_gpu_node(kube: Kube, namespace: str, product: str) -> None:
    try:
        kube.core.create_namespaced_pod(namespace, gpu_pod("gpu4", 4, product_affinity(product)))
        node_name = wait_until(lambda: scheduled_node(kube, namespace, "gpu4"), timeout=60, what="gpu4 bound")
        node = kube.core.read_node(node_name)
        assert node.metadata.labels[contract.LABEL_GPU_PRODUCT] == product
        assert int(node.status.allocatable[contract.RESOURCE_GPU]) >= 4
        # The scheduler records its Scheduled event asynchronously, after the binding is visible.
        scheduled = wait_until(
            lambda: [e for e in kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=gpu4").items
                     if e.reason == "Scheduled"],
            timeout=30, what="a Scheduled event")
        assert any(node_name in (e.message or "") for e in scheduled)
    finally:
        force_delete_pods(kube, namespace)


def test_pod_asking_9_gpus_stays_pending_with_the_schedulers_reason(kube: Kube, namespace: str,
                                                                   product: str) -> None:
    assert not gpu_nodes(kube, 9), "this test needs every GPU node to have fewer than 9 GPUs"
    kube.core.create_namespaced_pod(namespace, gpu_pod("gpu9", 9, product_affinity(product)))
    message = wait_until(lambda: unschedulable_message(kube, namespace, "gpu9"), timeout=60,
                         what="gpu9 marked Unschedulable")
    assert f"Insufficient {contract.RESOURCE_GPU}" in message
    events = wait_until(
        lambda: [e for e in kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=gpu9").items
                 if e.reason == "FailedScheduling"],
        timeout=30, what="a FailedScheduling event")
    assert f"Insufficient {contract.RESOURCE_GPU}" in (events[0].message or "")
    pod = kube.core.read_namespaced_pod("gpu9", namespace)
    assert pod.spec.node_name is None and pod.status.phase == "Pending"


def test_unknown_gpu_product_is_unschedulable_by_affinity(kube: Kube, namespace: str, product: str) -> None:
    kube.core.create_namespaced_pod(namespace, gpu_pod("nomatch", 1, product_affinity(product + "-NOT-THERE")))
    message = wait_until(lambda: unschedulable_message(kube, namespace, "nomatch"), timeout=60,
                         what="nomatch marked Unschedulable")
    assert "affinity" in message


def test_pod_affinity_on_the_nvlink_domain_packs_pods(cluster: Environment, kube: Kube, namespace: str) -> None:
    """Two 8-GPU pods that must share an NVLink domain (the operator's topologyKey packing) land on two
    different nodes of the same domain."""
    domains: dict[str, list[str]] = {}
    for node in gpu_nodes(kube, 8):
        domain = node.metadata.labels.get(contract.LABEL_NVLINK_DOMAIN)
        if domain:
            domains.setdefault(domain, []).append(node.metadata.name)
    pair = next((names for names in domains.values() if len(names) >= 2), None)
    if pair is None:
        pytest.fail(f"needs an NVLink domain with two 8-GPU nodes; found {domains}")
    group = {"app": "packed"}
    pin = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": contract.LABEL_HOSTNAME, "operator": "In", "values": [pair[0]]}]}]}}}
    affinity = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": group}, "topologyKey": contract.LABEL_NVLINK_DOMAIN}]}}
    try:
        kube.core.create_namespaced_pod(namespace, gpu_pod("packed-0", 8, pin, labels=group))
        first = wait_until(lambda: scheduled_node(kube, namespace, "packed-0"), timeout=60, what="packed-0 bound")
        kube.core.create_namespaced_pod(namespace, gpu_pod("packed-1", 8, affinity, labels=group))
        second = wait_until(lambda: scheduled_node(kube, namespace, "packed-1"), timeout=60, what="packed-1 bound")
        assert first != second
        labels = [kube.core.read_node(n).metadata.labels[contract.LABEL_NVLINK_DOMAIN] for n in (first, second)]
        assert labels[0] == labels[1]
    finally:
        force_delete_pods(kube, namespace)
