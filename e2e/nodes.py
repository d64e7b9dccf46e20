"""Simulated GPU nodes: Node objects with `nvidia.com/gpu` capacity and topology labels, kept Ready.

No kubelet runs for them: `NodeSimulator` creates the Nodes (status included) and a background thread
renews each node's Lease in `kube-node-lease` and re-asserts the Ready condition, which is all the node
lifecycle controller looks at. Nodes labelled `weightsync.io/process-node=true` have their pods run as
host processes by the process runtime (weightsync.e2e.runtime); the others only get pods scheduled.
These nodes are deliberately not managed by kwok (kwok's pod stages would force readiness gates True);
see e2e/kwok.py for large fake fleets.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from weightsync.crds import contract

log = logging.getLogger("weightsync.e2e.nodes")

JSON = dict[str, Any]
NODE_LEASE_NAMESPACE = "kube-node-lease"
LABEL_SIMULATED = "weightsync.io/simulated-node"   # "true" on every node NodeSimulator manages
DEFAULT_GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
KUBELET_VERSION = "v1.34.4"


@dataclass(frozen=True)
class GpuNodeSpec:
    """One simulated node: its GPUs, size and place in the topology (zone > rack > NVLink domain > host)."""

    name: str
    gpus: int = 8
    gpu_product: str = DEFAULT_GPU_PRODUCT
    cpu: str = "96"
    memory: str = "1024Gi"
    pods: int = 110
    zone: str = "zone-a"
    rack: str = "rack-0"
    nvlink_domain: str = "nvl-0"
    process: bool = True
    address: str = "127.0.0.1"
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()


def gpu_fleet(count: int = 4, *, gpus: int = 8, prefix: str = "gpu-node", nodes_per_rack: int = 2,
              racks_per_zone: int = 2, process: bool | int = True,
              gpu_product: str = DEFAULT_GPU_PRODUCT) -> list[GpuNodeSpec]:
    """COUNT nodes named PREFIX-0.., NODES_PER_RACK per rack (one NVLink domain per rack, as on an NVL
    rack), RACKS_PER_ZONE per zone. PROCESS: True (all), False (none) or the number of leading nodes
    that are process nodes."""
    specs = []
    for i in range(count):
        rack = i // max(1, nodes_per_rack)
        zone = rack // max(1, racks_per_zone)
        is_process = process if isinstance(process, bool) else i < process
        specs.append(GpuNodeSpec(
            name=f"{prefix}-{i}", gpus=gpus, gpu_product=gpu_product, zone=f"zone-{chr(ord('a') + zone % 26)}",
            rack=f"rack-{rack}", nvlink_domain=f"nvl-{rack}", process=is_process,
        ))
    return specs


def node_labels(spec: GpuNodeSpec) -> dict[str, str]:
    labels = {
        contract.LABEL_HOSTNAME: spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        contract.LABEL_ZONE: spec.zone,
        contract.LABEL_RACK: spec.rack,
        contract.LABEL_NVLINK_DOMAIN: spec.nvlink_domain,
        LABEL_SIMULATED: "true",
    }
    if spec.gpus > 0:
        labels[contract.LABEL_GPU_PRODUCT] = spec.gpu_product
        labels[contract.LABEL_GPU_COUNT] = str(spec.gpus)
        labels["nvidia.com/gpu.present"] = "true"
    if spec.process:
        labels[contract.LABEL_PROCESS_NODE] = "true"
    labels.update(spec.extra_labels)
    return labels


def _now() -> datetime:
    return datetime.now(timezone.utc)


def rfc3339(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ready_conditions(now: datetime) -> list[JSON]:
    """What a healthy kubelet reports."""
    stamp = rfc3339(now)

    def cond(type_: str, status: str, reason: str, message: str) -> JSON:
        return {"type": type_, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}

    return [
        cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        cond("Ready", "True", "KubeletReady", "simulated by weightsync.e2e.nodes"),
    ]


def node_status(spec: GpuNodeSpec, now: datetime) -> JSON:
    resources = {"cpu": spec.cpu, "memory": spec.memory, "pods": str(spec.pods), "ephemeral-storage": "1000Gi"}
    if spec.gpus > 0:
        resources[contract.RESOURCE_GPU] = str(spec.gpus)
    return {
        "capacity": dict(resources),
        "allocatable": dict(resources),
        "conditions": ready_conditions(now),
        "addresses": [{"type": "InternalIP", "address": spec.address}, {"type": "Hostname", "address": spec.name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "architecture": "amd64", "operatingSystem": "linux", "osImage": "weightsync simulated node",
            "kernelVersion": "", "containerRuntimeVersion": "weightsync-process://0" if spec.process else "none://0",
            "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "", "machineID": spec.name,
            "systemUUID": spec.name, "bootID": spec.name,
        },
    }


def node_manifest(spec: GpuNodeSpec, now: datetime | None = None) -> JSON:
    """The whole Node object (metadata, spec, status) for SPEC."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": node_labels(spec)},
        "spec": {"taints": [dict(t) for t in spec.taints]} if spec.taints else {},
        "status": node_status(spec, now or _now()),
    }


def lease_manifest(node: str, node_uid: str, now: datetime, duration_s: int) -> JSON:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": node, "namespace": NODE_LEASE_NAMESPACE,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": {"holderIdentity": node, "leaseDurationSeconds": duration_s, "renewTime": micro_time(now)},
    }


class NodeSimulator:
    """Creates the nodes of SPECS and keeps them Ready until stop().

    API_CLIENT: a factory of admin ApiClients (e.g. `LocalCluster.api_client`); the heartbeat thread
    gets its own client. RENEW_S: lease renewal period (a kubelet renews every 10 s); STATUS_S: how
    often the Ready condition is re-asserted (restores it if the lifecycle controller ever flipped it).
    """

    def __init__(self, api_client: Callable[[], kubernetes.client.ApiClient], specs: Iterable[GpuNodeSpec], *,
                 lease_duration_s: int = 40, renew_s: float = 10.0, status_s: float = 30.0) -> None:
        self._factory = api_client
        self.specs = list(specs)
        self.lease_duration_s = lease_duration_s
        self.renew_s = renew_s
        self.status_s = status_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._uids: dict[str, str] = {}
        self.heartbeats = 0

    @property
    def node_names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def process_node_names(self) -> list[str]:
        return [s.name for s in self.specs if s.process]

    def start(self) -> NodeSimulator:
        """Create (or update) every node and its lease, then start the heartbeat thread."""
        with self._factory() as api:
            core = kubernetes.client.CoreV1Api(api)
            coord = kubernetes.client.CoordinationV1Api(api)
            for spec in self.specs:
                self._uids[spec.name] = self._ensure_node(core, spec)
            self._renew_leases(coord)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)
        self._thread.start()
        log.info("simulated nodes ready count=%s process=%s", len(self.specs), self.process_node_names)
        return self

    def stop(self, delete: bool = False) -> None:
        """Stop heartbeating; DELETE also removes the Node objects (their leases go by GC)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if delete:
            with self._factory() as api:
                core = kubernetes.client.CoreV1Api(api)
                for name in self.node_names:
                    with contextlib.suppress(ApiException):
                        core.delete_node(name)

    def _ensure_node(self, core: kubernetes.client.CoreV1Api, spec: GpuNodeSpec) -> str:
        body: Any = node_manifest(spec)  # the client accepts plain dicts
        try:
            created = core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            core.patch_node(spec.name, {"metadata": {"labels": body["metadata"]["labels"]}})
            created = core.read_node(spec.name)
        # Status on create is kept for nodes, but set it again so a pre-existing node is current too.
        core.patch_node_status(spec.name, {"status": node_status(spec, _now())})
        assert created.metadata is not None
        return str(created.metadata.uid)

    def _renew_leases(self, coord: kubernetes.client.CoordinationV1Api) -> None:
        now = _now()
        for name, uid in self._uids.items():
            try:
                coord.patch_namespaced_lease(name, NODE_LEASE_NAMESPACE, {"spec": {
                    "holderIdentity": name, "leaseDurationSeconds": self.lease_duration_s,
                    "renewTime": micro_time(now)}})
            except ApiException as exc:
                if exc.status != 404:
                    raise
                lease: Any = lease_manifest(name, uid, now, self.lease_duration_s)
                coord.create_namespaced_lease(NODE_LEASE_NAMESPACE, lease)
        self.heartbeats += 1

    def _refresh_status(self, core: kubernetes.client.CoreV1Api) -> None:
        # Without lastTransitionTime: the strategic merge keeps the one already there.
        conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in ready_conditions(_now())]
        for spec in self.specs:
            core.patch_node_status(spec.name, {"status": {"conditions": conditions}})

    def _run(self) -> None:
        with self._factory() as api:
            core = kubernetes.client.CoreV1Api(api)
            coord = kubernetes.client.CoordinationV1Api(api)
            ticks_per_status = max(1, round(self.status_s / self.renew_s))
            tick = 0
            while not self._stop.wait(self.renew_s):
                tick += 1
                try:
                    self._renew_leases(coord)
                    if tick % ticks_per_status == 0:
                        self._refresh_status(core)
                except Exception as exc:  # keep heartbeating through apiserver hiccups
                    log.warning("node heartbeat failed error=%s", exc)
