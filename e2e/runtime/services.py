"""Services for process pods: a userspace proxy per ClusterIP Service, the way kube-proxy makes them reachable.

Pods here share the host's network namespace and can only use loopback addresses, and several clusters may
run on one machine at once, so a Service's real `spec.clusterIP` (allocated by each apiserver from its own
range) is not used. Instead each Service with a ClusterIP gets its own loopback address from the runtime's
machine-wide IP leases (`SERVICE_CIDR`, 127.96.0.0/16 by default, one lock file per address like pod IPs),
and the proxy listens on that address, one ephemeral port per TCP port of the Service. Address and port
stand in for the ClusterIP and the Service's port: the service-link env (`<NAME>_SERVICE_HOST` and
`<NAME>_SERVICE_PORT*`, see envvars.service_link_env) carries them. Not the Service's own port number: pods
share the host's network namespace, and a pod listening on 0.0.0.0 at that number (the operator's metrics
port behind its metrics Service) would collide with the proxy.

Every accepted connection goes to one *ready* endpoint of the Service, picked at random per connection like
kube-proxy's iptables mode. No ready endpoint (or the per-Service connection limit reached): the connection
is reset at once (kube-proxy REJECTs). Established connections are left alone when endpoints change
(conntrack keeps them in kube-proxy too).

Endpoints: the apiserver refuses loopback addresses in EndpointSlices (and Endpoints), so the EndpointSlice
controller cannot publish process pods (127.x pod IPs). For a Service with a selector the proxy therefore
computes the endpoints the way that controller would, from the pods: same namespace, labels matching the
selector, a pod IP, not terminal, not being deleted, `Ready` condition True (unless
`publishNotReadyAddresses`), port from `targetPort` (a number, or a named container port). A Service without
a selector uses its EndpointSlices (label `kubernetes.io/service-name`; `conditions.ready` unset counts as
ready, as in kube-proxy). Services, EndpointSlices and pods of all namespaces are list+watched, so a pod
that turns not Ready stops getting new connections as soon as its status says so.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import struct
import threading
import time
from typing import Any

import requests

from weightsync.e2e.runtime.envvars import has_cluster_ip
from weightsync.e2e.runtime.ips import PodIPAllocator
from weightsync.e2e.runtime.kube import ApiError, KubeClient, abort_watch

log = logging.getLogger(__name__)
JSON = dict[str, Any]
Key = tuple[str, str]  # (namespace, name)

DEFAULT_SERVICE_CIDR = "127.96.0.0/16"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICES_PATH = "/api/v1/services"
SLICES_PATH = "/apis/discovery.k8s.io/v1/endpointslices"
PODS_PATH = "/api/v1/pods"
# The apiserver's own Service: pods reach the real apiserver through KUBERNETES_SERVICE_HOST (envvars.service_env).
APISERVER_SERVICE: Key = ("default", "kubernetes")


# --- pure ------------------------------------------------------------------------------------------------
def proxied(service: JSON) -> bool:
    """Services the proxy serves: a ClusterIP (not headless, not ExternalName), not the apiserver's own."""
    meta = service.get("metadata") or {}
    if (meta.get("namespace"), meta.get("name")) == APISERVER_SERVICE:
        return False
    return (service.get("spec") or {}).get("type") != "ExternalName" and has_cluster_ip(service)


def tcp_ports(service: JSON) -> dict[int, str]:
    """Service port -> port name ('' when unnamed) of its TCP ports."""
    return {
        int(p["port"]): str(p.get("name") or "")
        for p in (service.get("spec") or {}).get("ports") or []
        if str(p.get("protocol") or "TCP") == "TCP"
    }


def ready_backends(port_name: str, slices: list[JSON]) -> list[tuple[str, int]]:
    """The (IP, port) of every ready IPv4 endpoint of `slices` on the slice port named `port_name`, deduplicated
    (an endpoint may sit in two slices while the controller moves it), sorted."""
    found: set[tuple[str, int]] = set()
    for eps in slices:
        if eps.get("addressType", "IPv4") != "IPv4":
            continue
        port = next(
            (p.get("port") for p in eps.get("ports") or []
             if str(p.get("name") or "") == port_name and str(p.get("protocol") or "TCP") == "TCP"),
            None,
        )
        if port is None:
            continue
        for endpoint in eps.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                found.add((str(address), int(port)))
    return sorted(found)


def _pod_ready(pod: JSON) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _container_port(pod: JSON, name: str, protocol: str) -> int | None:
    """A named container port of the pod (app containers, then native sidecars), like podutil.FindPort."""
    spec = pod.get("spec") or {}
    containers = (spec.get("containers") or []) + [
        c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"
    ]
    for container in containers:
        for port in container.get("ports") or []:
            if port.get("name") == name and str(port.get("protocol") or "TCP") == protocol:
                return int(port["containerPort"])
    return None


def pod_backends(service: JSON, port_name: str, pods: list[JSON]) -> list[tuple[str, int]]:
    """The EndpointSlice controller's endpoints for a Service with a selector, ready ones only: (pod IP, target
    port) of the pods of its namespace matching the selector that have an IP, are not terminal or being
    deleted, and are Ready (any readiness with `publishNotReadyAddresses`). Sorted."""
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    namespace = (service.get("metadata") or {}).get("namespace")
    port = next((p for p in spec.get("ports") or [] if str(p.get("name") or "") == port_name), None)
    if not selector or port is None:
        return []
    protocol = str(port.get("protocol") or "TCP")
    target = port.get("targetPort") or port["port"]
    found: set[tuple[str, int]] = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        labels = meta.get("labels") or {}
        if meta.get("namespace") != namespace or any(labels.get(k) != v for k, v in selector.items()):
            continue
        if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed") or meta.get("deletionTimestamp"):
            continue
        if not spec.get("publishNotReadyAddresses") and not _pod_ready(pod):
            continue
        number = int(target) if isinstance(target, int) or str(target).isdigit() else (
            _container_port(pod, str(target), protocol))
        if number is not None:
            found.add((str(status["podIP"]), number))
    return sorted(found)


# --- sockets ---------------------------------------------------------------------------------------------
def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the client sees the connection refused/reset at once."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(how)


class _Connection:
    """One proxied connection: client <-> backend, one thread per direction."""

    def __init__(self, client: socket.socket, backend: tuple[str, int]) -> None:
        self.client = client
        self.backend = backend
        self.upstream: socket.socket | None = None
        self.closed = False

    def close(self) -> None:
        """Wake both directions (stop): shutdown makes their blocked recv return."""
        self.closed = True
        _shutdown(self.client)
        if self.upstream is not None:
            _shutdown(self.upstream)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src -> dst until EOF, then half-close dst; on an error, shut both down so the peer pump ends."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                _shutdown(dst, socket.SHUT_WR)
                return
            dst.sendall(data)
    except OSError:
        _shutdown(src)
        _shutdown(dst)


class _ServiceListeners:
    """The proxy's address for one Service and a listening socket + accept thread per TCP port."""

    def __init__(self, proxy: ServiceProxy, key: Key, uid: str, address: str) -> None:
        self.proxy = proxy
        self.key = key
        self.uid = uid
        self.address = address
        self.ports: dict[int, tuple[str, socket.socket, threading.Thread]] = {}
        self.bound: dict[int, int] = {}  # Service port -> the proxy's port for it on `address`
        self.active: set[_Connection] = set()
        self.lock = threading.Lock()
        self._full_logged = 0.0

    def sync_ports(self, wanted: dict[int, str]) -> None:
        for port in [p for p in self.ports if p not in wanted or self.ports[p][0] != wanted[p]]:
            self._close_port(port)
        for port, name in wanted.items():
            if port in self.ports:
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.address, 0))
                sock.listen(128)
            except OSError as exc:
                sock.close()
                log.warning("service.proxy listen failed ns=%s name=%s listen=%s port=%d error=%s",
                            *self.key, self.address, port, exc)
                continue
            self.bound[port] = sock.getsockname()[1]
            thread = threading.Thread(target=self._accept, args=(sock, name), daemon=True,
                                      name=f"svc-{self.key[0]}/{self.key[1]}:{port}")
            self.ports[port] = (name, sock, thread)
            thread.start()

    def _close_port(self, port: int) -> None:
        _name, sock, thread = self.ports.pop(port)
        self.bound.pop(port, None)
        _shutdown(sock)  # wakes the blocked accept() (Linux)
        sock.close()
        if thread is not threading.current_thread():
            thread.join(5.0)

    def close(self) -> None:
        for port in list(self.ports):
            self._close_port(port)
        with self.lock:
            active = list(self.active)
        for conn in active:
            conn.close()

    def _accept(self, sock: socket.socket, port_name: str) -> None:
        while True:
            try:
                client, _peer = sock.accept()
            except OSError:
                return  # listener closed
            backends = self.proxy.backends(self.key, port_name)
            with self.lock:
                full = len(self.active) >= self.proxy.max_connections
            if not backends or full:
                if full and time.monotonic() - self._full_logged > 10:
                    self._full_logged = time.monotonic()
                    log.warning("service.proxy connection limit ns=%s name=%s limit=%d; resetting new connections",
                                *self.key, self.proxy.max_connections)
                _reset(client)
                continue
            conn = _Connection(client, random.choice(backends))
            with self.lock:
                self.active.add(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=f"svc-conn-{self.key[1]}")
            self.proxy.track(thread)
            thread.start()

    def _serve(self, conn: _Connection) -> None:
        try:
            try:
                upstream = socket.create_connection(conn.backend, timeout=self.proxy.connect_timeout_s)
            except OSError as exc:
                log.debug("service.proxy backend unreachable ns=%s name=%s backend=%s:%d error=%s",
                          *self.key, *conn.backend, exc)
                _reset(conn.client)
                return
            upstream.settimeout(None)
            for sock in (conn.client, upstream):  # small requests / replies go out at once, as through NAT
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.upstream = upstream
            if conn.closed:  # stopped while connecting
                upstream.close()
                conn.client.close()
                return
            back = threading.Thread(target=_pump, args=(upstream, conn.client), daemon=True,
                                    name=f"svc-conn-{self.key[1]}-back")
            back.start()
            _pump(conn.client, upstream)
            back.join()
            upstream.close()
            conn.client.close()
        finally:
            with self.lock:
                self.active.discard(conn)


# --- the proxy -------------------------------------------------------------------------------------------
class ServiceProxy:
    """Watches Services and EndpointSlices of all namespaces and proxies every ClusterIP Service's TCP ports.

    start() returns once both first lists are done (so pods started next see every existing Service in
    their env); stop() closes every listener and connection and joins every thread it started.
    """

    def __init__(
        self,
        client: KubeClient,
        addresses: PodIPAllocator,
        *,
        resync_s: float = 30.0,
        watch_timeout_s: int = 60,
        max_connections: int = 256,
        connect_timeout_s: float = 3.0,
    ) -> None:
        self.client = client
        self.addresses = addresses
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self._services: dict[Key, JSON] = {}
        self._slices: dict[Key, JSON] = {}  # by the slice's own (namespace, name)
        self._pods: dict[Key, JSON] = {}
        self._backends: dict[tuple[Key, str], list[tuple[str, int]]] = {}
        self._listeners: dict[Key, _ServiceListeners] = {}
        self._lock = threading.Lock()  # the caches and _backends
        self._sync_lock = threading.Lock()  # listeners (one reconcile at a time)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conn_threads: set[threading.Thread] = set()
        self._watches: dict[str, requests.Response] = {}
        self._listed = {path: threading.Event() for path in (SERVICES_PATH, SLICES_PATH, PODS_PATH)}

    # --- public ----------------------------------------------------------------------------------------
    def start(self, wait_s: float = 30.0) -> None:
        for path in self._listed:
            thread = threading.Thread(target=self._watch, args=(path,), daemon=True, name=f"svc-watch-{path}")
            thread.start()
            self._threads.append(thread)
        deadline = time.monotonic() + wait_s
        for path, listed in self._listed.items():
            if not listed.wait(max(deadline - time.monotonic(), 0.0)):
                log.warning("service.proxy initial list not done yet path=%s", path)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            watches = list(self._watches.values())
        for resp in watches:
            abort_watch(resp)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
        with self._sync_lock:
            for key in list(self._listeners):
                self._drop(key)
        with self._lock:
            conn_threads = list(self._conn_threads)
        for thread in conn_threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
        left = [t.name for t in self._threads + conn_threads if t.is_alive()]
        if left:
            log.warning("service.proxy threads still running after stop threads=%s", left)
        log.info("service.proxy stopped")

    def address(self, namespace: str, name: str) -> str | None:
        """The address pods use for that Service (its stand-in ClusterIP), None when not proxied."""
        listeners = self._listeners.get((namespace, name))
        return listeners.address if listeners is not None else None

    def port(self, namespace: str, name: str, service_port: int) -> int | None:
        """The proxy's port (on `address`) for that Service port, None when not listening."""
        listeners = self._listeners.get((namespace, name))
        return listeners.bound.get(service_port) if listeners is not None else None

    def link_services(self, namespace: str) -> list[tuple[JSON, str, dict[int, int]]]:
        """(Service, proxy address, Service port -> proxy port) of every proxied Service of `namespace`: the
        pod's service links."""
        with self._lock:
            services = [s for (ns, _), s in self._services.items() if ns == namespace]
        links = []
        for service in services:
            listeners = self._listeners.get((namespace, service["metadata"]["name"]))
            if listeners is not None:
                links.append((service, listeners.address, dict(listeners.bound)))
        return links

    def backends(self, key: Key, port_name: str) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._backends.get((key, port_name), ()))

    def track(self, thread: threading.Thread) -> None:
        with self._lock:
            self._conn_threads = {t for t in self._conn_threads if t.is_alive()}
            self._conn_threads.add(thread)

    # --- reconcile -------------------------------------------------------------------------------------
    def _recompute(self, keys: set[Key]) -> None:
        """Rebuild the ready backends of `keys` (under _lock) and log the Services whose count changed."""
        for key in keys:
            service = self._services.get(key)
            old = {k: v for k, v in self._backends.items() if k[0] == key}
            for k in old:
                del self._backends[k]
            if service is None or not proxied(service):
                continue
            if (service.get("spec") or {}).get("selector"):
                pods = [p for (ns, _), p in self._pods.items() if ns == key[0]]
                for name in set(tcp_ports(service).values()):
                    self._backends[(key, name)] = pod_backends(service, name, pods)
            else:
                slices = [s for (ns, _), s in self._slices.items() if ns == key[0]
                          and ((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL) == key[1]]
                for name in set(tcp_ports(service).values()):
                    self._backends[(key, name)] = ready_backends(name, slices)
            new = {k: v for k, v in self._backends.items() if k[0] == key}
            if new != old and key in self._listeners:
                log.info("service.proxy endpoints ns=%s name=%s listen=%s endpoints=%s", *key,
                         self._listeners[key].address, ",".join(f"{k[1] or '-'}={len(v)}" for k, v in sorted(new.items())))

    def _sync_listeners(self, keys: set[Key]) -> None:
        with self._sync_lock:
            if self._stop.is_set():
                return
            for key in keys:
                with self._lock:
                    service = self._services.get(key)
                current = self._listeners.get(key)
                uid = (service or {}).get("metadata", {}).get("uid", "")
                if current is not None and (service is None or not proxied(service) or current.uid != uid):
                    self._drop(key)
                    current = None
                if service is None or not proxied(service):
                    continue
                fresh = current is None
                if current is None:
                    try:
                        address = self.addresses.allocate(f"service/{key[0]}/{key[1]}/{uid}")
                    except RuntimeError as exc:
                        log.warning("service.proxy no address ns=%s name=%s error=%s", *key, exc)
                        continue
                    current = _ServiceListeners(self, key, uid, address)
                wanted = tcp_ports(service)
                before = dict(current.ports)
                try:
                    current.sync_ports(wanted)
                except BaseException:
                    if fresh:  # never published: nothing else holds its sockets or its address
                        current.close()
                        self.addresses.release(f"service/{key[0]}/{key[1]}/{uid}")
                    raise
                if fresh:
                    # published once its ports are bound: a pod's service links (link_services) and address() /
                    # port() never see the address without its ports (a pod started in between got no port link)
                    self._listeners[key] = current
                if current.ports != before:
                    with self._lock:
                        ready = {name or "-": len(self._backends.get((key, name), ())) for name in set(wanted.values())}
                    log.info("service.proxy ns=%s name=%s listen=%s ports=%s endpoints=%s", *key, current.address,
                             ",".join(f"{p}->{current.bound[p]}" for p in sorted(current.bound)) or "none",
                             ",".join(f"{k}={v}" for k, v in sorted(ready.items())) or "0")

    def _drop(self, key: Key) -> None:
        listeners = self._listeners.pop(key)
        listeners.close()
        self.addresses.release(f"service/{key[0]}/{key[1]}/{listeners.uid}")
        log.info("service.proxy removed ns=%s name=%s listen=%s", *key, listeners.address)

    def _apply(self, path: str, kind: str, obj: JSON) -> None:
        """One watch event (or listed object with kind 'LISTED')."""
        meta = obj.get("metadata") or {}
        key: Key = (meta.get("namespace", ""), meta.get("name", ""))
        with self._lock:
            if path == SERVICES_PATH:
                affected = {key}
                if kind == "DELETED":
                    self._services.pop(key, None)
                else:
                    self._services[key] = obj
            elif path == PODS_PATH:
                affected = {k for k in self._services if k[0] == key[0]}
                if kind == "DELETED":
                    self._pods.pop(key, None)
                else:
                    self._pods[key] = obj
            else:
                old = self._slices.get(key)
                affected = {
                    (key[0], ((o.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL, ""))
                    for o in (old, obj) if o is not None
                }
                if kind == "DELETED":
                    self._slices.pop(key, None)
                else:
                    self._slices[key] = obj
            self._recompute(affected)
        if path == SERVICES_PATH:
            self._sync_listeners(affected)

    def _replace(self, path: str, items: list[JSON]) -> None:
        """A full list: replace that cache, then reconcile everything."""
        fresh = {((o.get("metadata") or {}).get("namespace", ""), (o.get("metadata") or {}).get("name", "")): o
                 for o in items}
        with self._lock:
            if path == SERVICES_PATH:
                self._services = fresh
            elif path == PODS_PATH:
                self._pods = fresh
            else:
                self._slices = fresh
            keys = set(self._services) | {k[0] for k in self._backends}
            self._recompute(keys)
        self._sync_listeners(keys | set(self._listeners))

    def _watch(self, path: str) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                listing = self.client.get(path)
                self._replace(path, listing.get("items") or [])
                self._listed[path].set()
                failures = 0
                version = listing["metadata"]["resourceVersion"]
                relist_at = time.monotonic() + self.resync_s
                while not self._stop.is_set() and time.monotonic() < relist_at:
                    timeout = int(max(min(self.watch_timeout_s, relist_at - time.monotonic()), 1))
                    for event in self.client.watch(path, {"resourceVersion": version}, timeout,
                                                   on_open=lambda resp: self._opened(path, resp)):
                        if self._stop.is_set():
                            return
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":
                            raise ApiError(int(obj.get("code", 0)), str(obj.get("message", "watch error")))
                        version = obj.get("metadata", {}).get("resourceVersion", version)
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            self._apply(path, str(kind), obj)
            except ApiError as exc:
                if self._stop.is_set():
                    return
                failures += 1
                delay = min(0.5 * 2 ** min(failures, 5), 10.0) if exc.status != 410 else 0.0
                log.log(logging.DEBUG if exc.status == 410 else logging.WARNING,
                        "service.proxy watch failed path=%s error=%s retry_in_s=%.1f", path, exc, delay)
                self._stop.wait(delay)
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("service.proxy watch crashed path=%s; relisting", path)
                self._stop.wait(1.0)
            finally:
                with self._lock:
                    self._watches.pop(path, None)

    def _opened(self, path: str, resp: requests.Response) -> None:
        with self._lock:
            self._watches[path] = resp
        if self._stop.is_set():
            abort_watch(resp)

