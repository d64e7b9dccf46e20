"""ProcessRuntime: the kubelet stand-in for process nodes (watches pods bound to them, one worker each).

One watch per node (fieldSelector spec.nodeName=<node>) keeps a worker per pod uid up to date; a relist
every `resync_s` (and after any watch failure) catches missed events, so apiserver restarts and
hiccups only delay things.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from weightsync.e2e.runtime.events import EventRecorder
from weightsync.e2e.runtime.images import ImageStore
from weightsync.e2e.runtime.ips import DEFAULT_LEASE_DIR, DEFAULT_POD_CIDR, HostLeases, PodIPAllocator
from weightsync.e2e.runtime.kube import ApiError, KubeClient, endpoint_from_kubeconfig, pod_path
from weightsync.e2e.runtime.orphans import kill_marked
from weightsync.e2e.runtime.pod_volumes import unmount_under
from weightsync.e2e.runtime.pod_worker import PodWorker, RuntimeContext, pod_dir_name
from weightsync.e2e.runtime.services import DEFAULT_SERVICE_CIDR, ServiceProxy

log = logging.getLogger(__name__)
JSON = dict[str, Any]
KUBE_ROOT_CA = "kube-root-ca.crt"


class ObjectCache:
    """ConfigMaps / Secrets by (kind, namespace, name) with a short TTL, shared by all pod workers."""

    def __init__(self, client: KubeClient, ttl_s: float, ca_pem: bytes) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._ca_pem = ca_pem
        self._cache: dict[tuple[str, str, str], tuple[float, JSON | None]] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, namespace: str, name: str) -> JSON | None:
        key = (kind, namespace, name)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self._ttl_s:
            return hit[1]
        try:
            obj: JSON | None = self._client.get(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
        except ApiError as exc:
            if exc.status != 404:
                if hit is not None:
                    return hit[1]
                raise
            obj = None
        if obj is None and kind == "configmaps" and name == KUBE_ROOT_CA and self._ca_pem:
            # the root-ca publisher of kube-controller-manager has not run (yet): serve the same CA
            obj = {"data": {"ca.crt": self._ca_pem.decode()}}
        with self._lock:
            self._cache[key] = (now, obj)
        return obj


class ProcessRuntime:
    """Runs the pods bound to `node_names` as host processes.

    start() returns once the first list of every node is done (pods are then starting in the
    background); stop() kills every child process (no orphans) and leaves the pod objects alone.
    """

    def __init__(
        self,
        kubeconfig: str,
        node_names: list[str],
        state_dir: Path,
        python_bin_dir: Path | None = None,
        *,
        pod_cidr: str = DEFAULT_POD_CIDR,
        ip_lease_dir: Path | None = DEFAULT_LEASE_DIR,
        resync_s: float = 30.0,
        watch_timeout_s: int = 60,
        volume_refresh_s: float = 2.0,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 20.0,
        tick_s: float = 0.25,
        images: ImageStore | None = None,
        service_cidr: str | None = DEFAULT_SERVICE_CIDR,
    ) -> None:
        if not node_names:
            raise ValueError("ProcessRuntime needs at least one node name (--nodes a,b)")
        self.kubeconfig = kubeconfig
        self.node_names = list(node_names)
        self.state_dir = Path(state_dir).resolve()
        self.python_bin_dir = Path(python_bin_dir) if python_bin_dir else Path(sys.executable).parent
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        endpoint = endpoint_from_kubeconfig(kubeconfig)
        self.client = KubeClient(endpoint)
        self._ips = PodIPAllocator(pod_cidr, HostLeases(ip_lease_dir) if ip_lease_dir else None)
        self._host_ips: dict[str, str] = {}
        # Services: one leased loopback address per ClusterIP Service (services.py); None: no proxy, no links
        self.services: ServiceProxy | None = None
        if service_cidr:
            leases = HostLeases(ip_lease_dir) if ip_lease_dir else None  # its own token: never shares a pod's IP
            self.services = ServiceProxy(self.client, PodIPAllocator(service_cidr, leases))
        tag = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:10]
        self.runtime_id = tag
        self.ctx = RuntimeContext(
            client=self.client,
            lookup=ObjectCache(self.client, ttl_s=min(volume_refresh_s, 1.5), ca_pem=endpoint.ca_pem()),
            api_host=endpoint.host,
            api_port=endpoint.port,
            python_bin_dir=self.python_bin_dir,
            pods_dir=self.state_dir / "pods",
            shm_root=Path("/dev/shm") / f"weightsync-runtime-{tag}",
            claims_dir=self.state_dir / "claims",
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
            volume_refresh_s=volume_refresh_s,
            tick_s=tick_s,
            resync_status_s=max(resync_s, 10.0),
            host_ip=self._host_ip,
            allocate_ip=self._allocate_ip,
            release_ip=self._ips.release,
            events=EventRecorder(self.client),
            runtime_id=tag,
            images=images,
            service_links=self.services.link_services if self.services is not None else None,
        )
        self._workers: dict[str, PodWorker] = {}
        self._done: dict[str, float] = {}  # uids whose worker finished (never re-admitted)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listed: dict[str, threading.Event] = {n: threading.Event() for n in self.node_names}

    # --- public API ------------------------------------------------------------------------------------
    def start(self, wait_s: float = 30.0) -> None:
        self.ctx.pods_dir.mkdir(parents=True, exist_ok=True)
        kill_marked(self.runtime_id)  # what a crashed runtime with this state dir left running
        unmount_under(self.ctx.pods_dir)
        if self.services is not None:
            self.services.start(wait_s)  # first: pods started next get every existing Service's links
        for node in self.node_names:
            thread = threading.Thread(target=self._watch_node, args=(node,), name=f"watch-{node}", daemon=True)
            thread.start()
            self._threads.append(thread)
        deadline = time.monotonic() + wait_s
        for node, listed in self._listed.items():
            if not listed.wait(max(deadline - time.monotonic(), 0.0)):
                log.warning("initial pod list not done yet node=%s (apiserver unreachable?)", node)
        log.info("process runtime started nodes=%s state_dir=%s", ",".join(self.node_names), self.state_dir)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.stop()
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.join(max(deadline - time.monotonic(), 0.1))
        kill_marked(self.runtime_id)  # children that left their process group
        unmount_under(self.ctx.pods_dir)
        self._ips.release_all()
        if self.services is not None:
            self.services.stop()
            self.services.addresses.release_all()
        self.ctx.events.close()
        shutil.rmtree(self.ctx.shm_root, ignore_errors=True)
        if self.ctx.images is not None:
            self.ctx.images.close()
        log.info("process runtime stopped pods=%d", len(workers))

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        """The log file of a container (current pod with that name, else the newest one seen)."""
        with self._lock:
            for worker in self._workers.values():
                if worker.namespace == namespace and worker.name == pod:
                    return worker.log_file(container)
        candidates = sorted(
            self.ctx.pods_dir.glob(pod_dir_name(namespace, pod, "*")), key=lambda p: p.stat().st_mtime
        )
        base = candidates[-1] if candidates else self.ctx.pods_dir / pod_dir_name(namespace, pod, "unknown")
        return base / f"{container}.log"

    def pod_ip(self, uid: str) -> str | None:
        return self._ips.get(uid)

    # --- helpers for workers ---------------------------------------------------------------------------
    def _host_ip(self, node: str) -> str:
        if node not in self._host_ips:
            ip = "127.0.0.1"
            try:
                obj = self.client.get(f"/api/v1/nodes/{node}")
                for addr in (obj.get("status") or {}).get("addresses") or []:
                    if addr.get("type") == "InternalIP":
                        ip = addr["address"]
                        break
            except ApiError as exc:
                log.warning("node lookup failed node=%s error=%s; hostIP=127.0.0.1", node, exc)
                return ip
            self._host_ips[node] = ip
        return self._host_ips[node]

    def _allocate_ip(self, uid: str, existing: str | None) -> str:
        if existing and self._ips.reserve(uid, existing):
            return existing
        return self._ips.allocate(uid)

    def _worker_exited(self, uid: str) -> None:
        with self._lock:
            self._workers.pop(uid, None)
            self._done[uid] = time.monotonic()

    # --- watch / dispatch ------------------------------------------------------------------------------
    def _dispatch(self, pod: JSON) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._lock:
            worker = self._workers.get(uid)
            done = uid in self._done
        if worker is not None:
            worker.update(pod)
            return
        if meta.get("deletionTimestamp") and (done or not (pod.get("status") or {}).get("podIP")):
            self._force_delete(pod)  # nothing runs for it: finish the deletion the kubelet way
            return
        if done or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return  # terminal pods are never run again
        if self._stop.is_set():
            return
        worker = PodWorker(self.ctx, pod, self._worker_exited)
        with self._lock:
            if uid in self._workers:
                return
            self._workers[uid] = worker
        worker.start()

    def _force_delete(self, pod: JSON) -> None:
        meta = pod["metadata"]
        try:
            self.client.delete(
                pod_path(meta["namespace"], meta["name"]), {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("pod delete failed pod=%s/%s error=%s", meta["namespace"], meta["name"], exc)

    def _removed(self, uid: str) -> None:
        with self._lock:
            worker = self._workers.get(uid)
        if worker is not None:
            worker.gone()

    def _watch_node(self, node: str) -> None:
        """List then watch the node's pods until stop; relist after errors, 410 Gone and every resync_s."""
        params = {"fieldSelector": f"spec.nodeName={node}"}
        failures = 0
        while not self._stop.is_set():
            try:
                listing = self.client.get("/api/v1/pods", **params)
                seen = set()
                for pod in listing.get("items") or []:
                    seen.add(pod["metadata"]["uid"])
                    self._dispatch(pod)
                with self._lock:
                    vanished = [
                        uid for uid, w in self._workers.items()
                        if uid not in seen and w.node_name == node
                    ]
                for uid in vanished:
                    self._removed(uid)
                self._listed[node].set()
                failures = 0
                version = listing["metadata"]["resourceVersion"]
                relist_at = time.monotonic() + self.resync_s
                while not self._stop.is_set() and time.monotonic() < relist_at:
                    timeout = int(max(min(self.watch_timeout_s, relist_at - time.monotonic()), 1))
                    for event in self.client.watch("/api/v1/pods", dict(params, resourceVersion=version), timeout):
                        if self._stop.is_set():
                            return
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":
                            raise ApiError(int(obj.get("code", 0)), str(obj.get("message", "watch error")))
                        version = obj.get("metadata", {}).get("resourceVersion", version)
                        if kind == "BOOKMARK":
                            continue
                        if kind == "DELETED":
                            self._removed(obj["metadata"]["uid"])
                        else:
                            self._dispatch(obj)
                self._gc_done()
            except ApiError as exc:
                if self._stop.is_set():
                    return
                failures += 1
                delay = min(0.5 * 2 ** min(failures, 5), 10.0) if exc.status != 410 else 0.0
                log.log(
                    logging.DEBUG if exc.status == 410 else logging.WARNING,
                    "pod watch failed node=%s error=%s retry_in_s=%.1f", node, exc, delay,
                )
                self._stop.wait(delay)
            except Exception:
                log.exception("pod watch crashed node=%s; relisting", node)
                self._stop.wait(1.0)

    def _gc_done(self) -> None:
        cutoff = time.monotonic() - 3600
        with self._lock:
            for uid in [u for u, t in self._done.items() if t < cutoff]:
                del self._done[uid]
