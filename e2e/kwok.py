"""Large simulated fleets with kwok: thousands of GPU nodes kept Ready (and their pods "Running") by one
kwok process run out of cluster against the apiserver.

kwok manages only nodes annotated `kwok.x-k8s.io/node=fake`, so the simulated nodes of e2e/nodes.py
(whose pods the process runtime really runs, readiness gates included) are never touched by kwok's pod
stages. kwok nodes carry the `kwok.x-k8s.io/node=fake:NoSchedule` taint: only pods that tolerate it land
there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException
from weightsync.e2e.binaries import find_binary
from weightsync.e2e.nodes import DEFAULT_GPU_PRODUCT, GpuNodeSpec, node_manifest
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
    status = node["status"]
    for key in ("conditions", "daemonEndpoints"):
        status.pop(key, None)
    status["nodeInfo"]["kubeletVersion"] = "fake"
    return node


def create_nodes(api: kubernetes.client.ApiClient, specs: Sequence[GpuNodeSpec], workers: int = 8) -> float:
    """Create the kwok nodes of SPECS concurrently (existing ones are left as they are); returns seconds."""
    core = kubernetes.client.CoreV1Api(api)
    api.configuration.connection_pool_maxsize = max(workers, api.configuration.connection_pool_maxsize or 0)

    def create(spec: GpuNodeSpec) -> None:
        body: Any = kwok_node_manifest(spec)
        try:
            core.create_node(body)
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
        page = core.list_node(label_selector=label_selector, limit=500, _continue=cont)
        for node in page.items:
            if any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or []):
                ready += 1
        cont = page.metadata._continue
        if not cont:
            return ready


def delete_nodes(api: kubernetes.client.ApiClient, label_selector: str = f"{LABEL_KWOK_NODE}=true") -> None:
    kubernetes.client.CoreV1Api(api).delete_collection_node(label_selector=label_selector)


class KwokController:
    """One `kwok` process managing every node annotated kwok.x-k8s.io/node=fake.

    `kwok` serves nothing (no --server-address), so it binds no port; stop() ends its process group.
    """

    def __init__(self, kubeconfig: str | Path, log_dir: str | Path, binary: Path | None = None,
                 lease_duration_s: int = 40) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.log_dir = Path(log_dir)
        self.binary = binary or find_binary("kwok")
        self.lease_duration_s = lease_duration_s
        self.proc: Proc | None = None

    def argv(self) -> list[str]:
        return [
            str(self.binary), f"--kubeconfig={self.kubeconfig}",
            # kwok reads ~/.kwok/kwok.yaml by default: point it at a file that does not exist, so nobody's
            # personal config changes the stages.
            f"--config={self.log_dir / 'kwok-none.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_VALUE}",
            f"--node-lease-duration-seconds={self.lease_duration_s}",
            "--cidr=10.244.0.0/16", "--node-ip=10.243.0.1",
        ]

    def start(self) -> KwokController:
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
