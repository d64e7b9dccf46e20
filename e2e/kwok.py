"""Large simulated fleets with kwok: thousands of GPU nodes kept Ready (and their pods "Running") by one
kwok process run out of cluster against the apiserver.

kwok manages only nodes annotated `kwok.x-k8s.io/node=fake`, so the simulated nodes of e2e/nodes.py
(whose pods the process runtime really runs, readiness gates included) are never touched by kwok's pod
stages. kwok nodes carry the `kwok.x-k8s.io/node=fake:NoSchedule` taint: only pods that tolerate it land
there.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from weightsync.e2e.binaries import find_binary
from weightsync.e2e.nodes import DEFAULT_GPU_PRODUCT, LABEL_SIMULATED, GpuNodeSpec, node_manifest
from weightsync.e2e.procs import Proc, stop_all

log = logging.getLogger("weightsync.e2e.kwok")

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_VALUE = "fake"
KWOK_TAINT = {"key": KWOK_ANNOTATION, "value": KWOK_VALUE, "effect": "NoSchedule"}
KWOK_TOLERATION = {"key": KWOK_ANNOTATION, "operator": "Equal", "value": KWOK_VALUE, "effect": "NoSchedule"}
LABEL_KWOK_NODE = "weightsync.io/kwok-node"   # "true" on every node made by kwok_fleet (select / delete them)


def kwok_fleet(count: int, *, prefix: str = "kwok-node", gpus: int = 8, nodes_per_rack: int = 18,
               racks_per_zone: int = 8, gpu_product: str = DEFAULT_GPU_PRODUCT) -> list[GpuNodeSpec]:
    """COUNT kwok GPU nodes with the same topology labels as the process-simulated ones (18 nodes per
    rack and NVLink domain, as an NVL72 rack of 4-GPU trays would have, by default)."""
    specs = []
    for i in range(count):
        rack = i // nodes_per_rack
        specs.append(GpuNodeSpec(
            name=f"{prefix}-{i}", gpus=gpus, gpu_product=gpu_product, zone=f"zone-{rack // racks_per_zone}",
            rack=f"rack-{rack}", nvlink_domain=f"nvl-{rack}", process=False,
            extra_labels={LABEL_KWOK_NODE: "true", "type": "kwok"}, taints=(KWOK_TAINT,),
        ))
    return specs


def kwok_node_manifest(spec: GpuNodeSpec) -> dict[str, Any]:
    """A Node kwok will manage: annotated, tainted, capacity set, and no conditions (kwok's
    node-initialize stage makes it Ready, which is what the tests check)."""
    node = node_manifest(spec)
    node["metadata"]["annotations"] = {KWOK_ANNOTATION: KWOK_VALUE, "node.alpha.kubernetes.io/ttl": "0"}
    node["metadata"]["labels"]["kubernetes.io/role"] = "agent"
    node["metadata"]["labels"].pop(LABEL_SIMULATED, None)  # that label means "kept Ready by NodeSimulator"
    status = node["status"]
    for key in ("conditions", "daemonEndpoints"):
        status.pop(key, None)
    status["nodeInfo"]["kubeletVersion"] = "fake"
    return node


def create_nodes(api: kubernetes.client.ApiClient, specs: Sequence[GpuNodeSpec], workers: int = 8) -> float:
    """Create the kwok nodes of SPECS concurrently (existing ones are left as they are); returns seconds."""
    core: Any = kubernetes.client.CoreV1Api(api)  # Any: raw (_preload_content=False) answers
    api.configuration.connection_pool_maxsize = max(workers, api.configuration.connection_pool_maxsize or 0)

    def create(spec: GpuNodeSpec) -> None:
        body: Any = kwok_node_manifest(spec)
        try:
            # The raw response: turning 1,000 answers into V1Node models costs more CPU than the creates.
            resp = core.create_node(body, _preload_content=False)
            resp.read()
            resp.release_conn()
        except ApiException as exc:
            if exc.status != 409:
                raise

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(create, specs))
    seconds = time.monotonic() - t0
    log.info("kwok nodes created count=%s seconds=%.2f", len(specs), seconds)
    return seconds


def ready_node_count(api: kubernetes.client.ApiClient, label_selector: str = f"{LABEL_KWOK_NODE}=true") -> int:
    """How many nodes matching LABEL_SELECTOR report Ready=True (one paged list)."""
    core: Any = kubernetes.client.CoreV1Api(api)
    ready, cont = 0, None
    while True:
        # Raw JSON, not V1Node models: a thousand models take seconds of CPU to build.
        resp = core.list_node(label_selector=label_selector, limit=500, _continue=cont, _preload_content=False)
        page = json.loads(resp.data)
        for node in page.get("items", []):
            conditions = node.get("status", {}).get("conditions") or []
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
                ready += 1
        cont = page.get("metadata", {}).get("continue")
        if not cont:
            return ready


def delete_nodes(api: kubernetes.client.ApiClient, label_selector: str = f"{LABEL_KWOK_NODE}=true") -> None:
    core: Any = kubernetes.client.CoreV1Api(api)
    resp = core.delete_collection_node(label_selector=label_selector, _preload_content=False)
    resp.read()  # raw: the answer lists every deleted node, too many to build models for
    resp.release_conn()


class KwokController:
    """One `kwok` process managing every node annotated kwok.x-k8s.io/node=fake.

    `kwok` serves nothing (no --server-address), so it binds no port; stop() ends its process group.
    """

    def __init__(self, kubeconfig: str | Path, log_dir: str | Path, binary: Path | None = None,
                 lease_duration_s: int = 120, parallelism: int = 16) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.log_dir = Path(log_dir)
        self.binary = binary or find_binary("kwok")
        # kwok renews a lease every duration/4: 120 s -> every 30 s, inside the node lifecycle controller's
        # 50 s grace, at a quarter of the apiserver load of a kubelet's 40 s (1,000 nodes: 33 vs 100 req/s).
        self.lease_duration_s = lease_duration_s
        self.parallelism = parallelism
        self.proc: Proc | None = None

    def argv(self) -> list[str]:
        return [
            str(self.binary), f"--kubeconfig={self.kubeconfig}",
            # kwok reads ~/.kwok/kwok.yaml by default: give it our own (empty) one, so nobody's personal
            # config changes the stages; with no Stage in it kwok uses its default fast stages.
            f"--config={self.config_path}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_VALUE}",
            f"--node-lease-duration-seconds={self.lease_duration_s}",
            "--cidr=10.244.0.0/16", "--node-ip=10.243.0.1",
            "--v=WARN",  # INFO logs every node patch: thousands of lines a minute at this scale
        ]

    @property
    def config_path(self) -> Path:
        return self.log_dir / "kwok.yaml"

    def start(self) -> KwokController:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            "apiVersion: config.kwok.x-k8s.io/v1alpha1\nkind: KwokConfiguration\noptions:\n"
            f"  nodePlayStageParallelism: {self.parallelism}\n  nodeLeaseParallelism: {self.parallelism}\n"
            f"  podPlayStageParallelism: {self.parallelism}\n")
        self.proc = Proc("kwok", self.argv(), self.log_dir / "kwok.log").start()
        time.sleep(0.5)
        if not self.proc.alive():
            raise RuntimeError(f"kwok exited at once (log {self.proc.log_path}):\n{self.proc.tail()}")
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self) -> None:
        if self.proc is not None:
            stop_all([self.proc])
            self.proc = None


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 1.0) -> float:
    """Poll PREDICATE until true; returns the seconds it took, raises TimeoutError after TIMEOUT."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - t0
