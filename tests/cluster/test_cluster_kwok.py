"""Scale: 1,000 kwok GPU nodes become Ready under the real control plane and GPU pods get scheduled on them.

Runs on its own LocalCluster (1,000 nodes would slow down every other test of the session cluster)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from weightsync.crds import contract
from weightsync.e2e.cluster import LocalCluster
from weightsync.e2e.kwok import (
    KWOK_TOLERATION,
    LABEL_KWOK_NODE,
    KwokController,
    create_nodes,
    kwok_fleet,
    ready_node_count,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NODES = int(os.environ.get("WEIGHTSYNC_KWOK_NODES", "1000"))
REPLICAS = 50


@pytest.fixture(scope="module")
def scale_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # On a 2-core machine one kwok process renewing 1,000 leases can fall behind by more than the default
    # 50 s grace (measured under load: up to 10% of the nodes flapped to Unknown); this is a scale test
    # of kwok + scheduler, not of node failure detection, so give the node lifecycle controller slack.
    grace = ["--node-monitor-grace-period=3m", "--node-startup-grace-period=5m"]
    with LocalCluster(kubeconfig=tmp_path_factory.mktemp("kwok") / "kubeconfig",
                      extra_controller_manager_args=grace) as cluster:
        yield cluster


def test_1000_kwok_nodes_become_ready_and_take_gpu_pods(scale_cluster: LocalCluster) -> None:
    kwok = KwokController(scale_cluster.kubeconfig, scale_cluster.log_dir).start()
    timings: dict[str, float] = {}
    with scale_cluster.api_client() as api:
        core: Any = kubernetes.client.CoreV1Api(api)  # Any: plain-dict bodies, no Optional noise
        apps: Any = kubernetes.client.AppsV1Api(api)
        try:
            timings["create_s"] = create_nodes(api, kwok_fleet(NODES))
            timings["ready_s"] = wait_for(lambda: ready_node_count(api) == NODES, timeout=300,
                                          what=f"{NODES} kwok nodes Ready")
            assert kwok.alive()
            node = core.read_node("kwok-node-0")
            assert node.status.allocatable[contract.RESOURCE_GPU] == "8"  # kwok kept our capacity
            assert node.metadata.labels[contract.LABEL_NVLINK_DOMAIN] == "nvl-0"

            # Every pod takes a whole 8-GPU node, so REPLICAS pods need REPLICAS distinct nodes.
            labels = {"app": "kwok-gpu"}
            core.create_namespace({"metadata": {"name": "kwok-scale"}})
            wait_for(lambda: bool(core.list_namespaced_service_account("kwok-scale").items), 60, "default SA")
            apps.create_namespaced_deployment("kwok-scale", {
                "metadata": {"name": "gpu"},
                "spec": {"replicas": REPLICAS, "selector": {"matchLabels": labels}, "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "tolerations": [KWOK_TOLERATION],
                        "nodeSelector": {LABEL_KWOK_NODE: "true"},
                        "containers": [{"name": "c", "image": "weightsync.local/none",
                                        "resources": {"limits": {contract.RESOURCE_GPU: "8"}}}]}}},
            })

            def running() -> list[Any]:
                pods = core.list_namespaced_pod("kwok-scale", label_selector="app=kwok-gpu").items
                return [p for p in pods if p.status.phase == "Running" and p.spec.node_name]

            timings["pods_running_s"] = wait_for(lambda: len(running()) == REPLICAS, timeout=120,
                                                 what=f"{REPLICAS} pods Running on kwok nodes")
            pods = running()
            nodes = {p.spec.node_name for p in pods}
            assert len(nodes) == REPLICAS, "two 8-GPU pods shared a node"
            assert all(n.startswith("kwok-node-") for n in nodes)
            assert all(p.status.pod_ip for p in pods)
        finally:
            # No node deletion: this cluster is private to the module and goes away whole.
            kwok.stop()
            print(json.dumps({"kwok_nodes": NODES, **{k: round(v, 2) for k, v in timings.items()}}))


def test_kwok_controller_leaves_no_process(scale_cluster: LocalCluster, tmp_path: Path) -> None:
    from weightsync.e2e.procs import group_members, pid_alive

    kwok = KwokController(scale_cluster.kubeconfig, tmp_path).start()
    pid = kwok.pid
    assert pid is not None and pid_alive(pid)
    kwok.stop()
    assert not pid_alive(pid) and not group_members(pid)
