"""The process runtime's Services: service-link env names (pure) and the userspace proxy (real sockets, no cluster).

The proxy tests feed Service / EndpointSlice objects straight into the proxy's caches (what its watches do)
and talk to two tiny HTTP servers on their own 127.x addresses through it.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from weightsync.e2e.runtime import services as services_mod
from weightsync.e2e.runtime.envvars import container_env, env_var_name, expand, service_link_env
from weightsync.e2e.runtime.ips import DEFAULT_LEASE_DIR, HostLeases, PodIPAllocator
from weightsync.e2e.runtime.kube import ApiEndpoint, KubeClient
from weightsync.e2e.runtime.services import (
    SERVICES_PATH,
    SLICES_PATH,
    ServiceProxy,
    pod_backends,
    proxied,
    ready_backends,
    tcp_ports,
)

JSON = dict[str, Any]


def service(name: str, ports: list[JSON], cluster_ip: str = "10.96.3.4", ns: str = "ns", **spec: Any) -> JSON:
    return {"metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
            "spec": {"clusterIP": cluster_ip, "ports": ports, **spec}}


def endpoint_slice(name: str, svc: str, port_name: str, port: int, endpoints: list[tuple[str, bool | None]],
                   ns: str = "ns") -> JSON:
    return {
        "metadata": {"name": name, "namespace": ns, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {} if ready is None else {"ready": ready}}
                      for ip, ready in endpoints],
    }


# --- service-link env (pure) -----------------------------------------------------------------------------
def test_env_var_name_follows_the_kubelet() -> None:
    assert env_var_name("demo-rl-inference") == "DEMO_RL_INFERENCE"
    assert env_var_name("http") == "HTTP"
    assert env_var_name("ws-control") == "WS_CONTROL"


def test_service_link_env_names_values_and_docker_links() -> None:
    svc = service("demo-rl-inference", [
        {"name": "http", "port": 8000, "targetPort": 8000, "protocol": "TCP"},
        {"name": "grpc-api", "port": 9000, "protocol": "TCP"},
    ])
    env = service_link_env([(svc, "127.96.0.7", {})])
    assert env == {
        "DEMO_RL_INFERENCE_SERVICE_HOST": "127.96.0.7",  # the proxy's address, not spec.clusterIP
        "DEMO_RL_INFERENCE_SERVICE_PORT": "8000",
        "DEMO_RL_INFERENCE_SERVICE_PORT_HTTP": "8000",
        "DEMO_RL_INFERENCE_SERVICE_PORT_GRPC_API": "9000",
        "DEMO_RL_INFERENCE_PORT": "tcp://127.96.0.7:8000",
        "DEMO_RL_INFERENCE_PORT_8000_TCP": "tcp://127.96.0.7:8000",
        "DEMO_RL_INFERENCE_PORT_8000_TCP_PROTO": "tcp",
        "DEMO_RL_INFERENCE_PORT_8000_TCP_PORT": "8000",
        "DEMO_RL_INFERENCE_PORT_8000_TCP_ADDR": "127.96.0.7",
        "DEMO_RL_INFERENCE_PORT_9000_TCP": "tcp://127.96.0.7:9000",
        "DEMO_RL_INFERENCE_PORT_9000_TCP_PROTO": "tcp",
        "DEMO_RL_INFERENCE_PORT_9000_TCP_PORT": "9000",
        "DEMO_RL_INFERENCE_PORT_9000_TCP_ADDR": "127.96.0.7",
    }
    # the proxy's own ports (not the Service's: a pod may listen on 0.0.0.0 at that number)
    mapped = service_link_env([(svc, "127.96.0.7", {8000: 41001, 9000: 41002})])
    assert mapped["DEMO_RL_INFERENCE_SERVICE_PORT"] == mapped["DEMO_RL_INFERENCE_SERVICE_PORT_HTTP"] == "41001"
    assert mapped["DEMO_RL_INFERENCE_SERVICE_PORT_GRPC_API"] == "41002"
    assert mapped["DEMO_RL_INFERENCE_PORT_8000_TCP"] == "tcp://127.96.0.7:41001"
    assert mapped["DEMO_RL_INFERENCE_PORT_9000_TCP_PORT"] == "41002"


def test_service_link_env_skips_headless_and_portless_and_unnamed_port_has_no_suffix() -> None:
    headless = service("peers", [{"name": "x", "port": 1}], cluster_ip="None")
    portless = service("empty", [])
    unnamed = service("web", [{"port": 80}])
    env = service_link_env([(headless, "127.96.0.1", {}), (portless, "127.96.0.2", {}), (unnamed, "127.96.0.3", {})])
    assert not any(k.startswith(("PEERS_", "EMPTY_")) for k in env)
    assert env["WEB_SERVICE_HOST"] == "127.96.0.3" and env["WEB_SERVICE_PORT"] == "80"
    assert not any(k.startswith("WEB_SERVICE_PORT_") for k in env)


def test_pod_env_wins_over_service_links_and_args_expand_them() -> None:
    links = service_link_env([(service("echo", [{"name": "http", "port": 8080}]), "127.96.0.9", {})])
    pod = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {}}
    spec = {"env": [{"name": "ECHO_SERVICE_PORT", "value": "mine"},
                    {"name": "URL", "value": "http://$(ECHO_SERVICE_HOST):$(ECHO_SERVICE_PORT_HTTP)/"}]}
    env = container_env(pod, spec, "127.100.0.5", "127.0.0.1", lambda *_: None, links)
    assert env["ECHO_SERVICE_PORT"] == "mine"
    assert env["URL"] == "http://127.96.0.9:8080/"
    assert expand("$(ECHO_SERVICE_HOST):$(ECHO_SERVICE_PORT_HTTP)", env) == "127.96.0.9:8080"


# --- endpoint selection (pure) ---------------------------------------------------------------------------
def test_ready_backends_by_port_name_ready_only_and_deduplicated() -> None:
    slices = [
        endpoint_slice("a", "s", "http", 18080, [("127.100.0.2", True), ("127.100.0.3", False), ("127.100.0.4", None)]),
        endpoint_slice("b", "s", "http", 18080, [("127.100.0.2", True)]),  # moving between slices
        endpoint_slice("c", "s", "metrics", 9090, [("127.100.0.9", True)]),
        {**endpoint_slice("d", "s", "http", 18080, [("fd00::1", True)]), "addressType": "IPv6"},
    ]
    assert ready_backends("http", slices) == [("127.100.0.2", 18080), ("127.100.0.4", 18080)]
    assert ready_backends("metrics", slices) == [("127.100.0.9", 9090)]
    assert ready_backends("other", slices) == []


def _pod(name: str, ip: str, ready: bool, labels: JSON | None = None, ns: str = "ns", **extra: Any) -> JSON:
    return {
        "metadata": {"name": name, "namespace": ns, "labels": labels if labels is not None else {"app": "x"},
                     **extra.pop("meta", {})},
        "spec": {"containers": [{"name": "c", "ports": [{"name": "web", "containerPort": 18080}]}],
                 "initContainers": [{"name": "side", "restartPolicy": "Always",
                                     "ports": [{"name": "side", "containerPort": 19090}]}]},
        "status": {"podIP": ip, "phase": extra.pop("phase", "Running"),
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_pod_backends_like_the_endpointslice_controller() -> None:
    pods = [
        _pod("ready", "127.100.0.2", True),
        _pod("not-ready", "127.100.0.3", False),
        _pod("other-app", "127.100.0.4", True, labels={"app": "y"}),
        _pod("other-ns", "127.100.0.5", True, ns="elsewhere"),
        _pod("no-ip", "", True),
        _pod("done", "127.100.0.6", True, phase="Succeeded"),
        _pod("deleting", "127.100.0.7", True, meta={"deletionTimestamp": "2026-01-01T00:00:00Z"}),
    ]
    svc = service("s", [{"name": "http", "port": 80, "targetPort": "web"}, {"name": "num", "port": 81, "targetPort": 9000},
                        {"name": "same", "port": 82}, {"name": "sc", "port": 83, "targetPort": "side"},
                        {"name": "missing", "port": 84, "targetPort": "nope"}], selector={"app": "x"})
    assert pod_backends(svc, "http", pods) == [("127.100.0.2", 18080)]
    assert pod_backends(svc, "num", pods) == [("127.100.0.2", 9000)]
    assert pod_backends(svc, "same", pods) == [("127.100.0.2", 82)]
    assert pod_backends(svc, "sc", pods) == [("127.100.0.2", 19090)]  # a native sidecar's named port
    assert pod_backends(svc, "missing", pods) == []
    publish = {**svc, "spec": {**svc["spec"], "publishNotReadyAddresses": True}}
    assert pod_backends(publish, "http", pods) == [("127.100.0.2", 18080), ("127.100.0.3", 18080)]
    assert pod_backends({**svc, "spec": {**svc["spec"], "selector": {}}}, "http", pods) == []


def test_proxied_services_and_tcp_ports() -> None:
    assert proxied(service("web", [{"port": 80}]))
    assert not proxied(service("peers", [{"port": 80}], cluster_ip="None"))
    assert not proxied(service("ext", [], cluster_ip="", type="ExternalName"))
    assert not proxied(service("kubernetes", [{"port": 443}], ns="default"))
    assert tcp_ports(service("m", [{"name": "a", "port": 1}, {"name": "u", "port": 2, "protocol": "UDP"},
                                   {"port": 3, "protocol": "TCP"}])) == {1: "a", 3: ""}


# --- the proxy on real sockets ---------------------------------------------------------------------------
class _Named(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def backends() -> Iterator[list[tuple[str, int]]]:
    """Two HTTP servers answering their name, on two leased pod-style addresses (port chosen by the kernel)."""
    alloc = PodIPAllocator("127.100.0.0/16", HostLeases(DEFAULT_LEASE_DIR))
    servers = []
    for name in ("a", "b"):
        server = http.server.ThreadingHTTPServer((alloc.allocate(name), 0), _Named)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [(str(s.server_address[0]), int(s.server_address[1])) for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()
    alloc.release_all()


@pytest.fixture
def proxy() -> Iterator[ServiceProxy]:
    client = KubeClient(ApiEndpoint("https://127.0.0.1:1", None, None, None, None, False))  # never called
    p = ServiceProxy(client, PodIPAllocator("127.96.0.0/16", HostLeases(DEFAULT_LEASE_DIR)), connect_timeout_s=1)
    yield p
    p.stop()
    p.addresses.release_all()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def test_proxy_spreads_over_ready_endpoints_and_drops_not_ready(proxy: ServiceProxy, backends: list[tuple[str, int]],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="weightsync.e2e.runtime.services")
    (ip_a, port_a), (ip_b, port_b) = backends
    assert port_a != port_b or ip_a != ip_b
    proxy._replace(SERVICES_PATH, [service("echo", [{"name": "http", "port": 8080, "targetPort": "web"}])])
    address = proxy.address("ns", "echo")
    assert address is not None and address.startswith("127.96.")
    port = proxy.port("ns", "echo", 8080)
    assert port is not None and port != 8080, "an ephemeral port: pods may listen on 0.0.0.0:8080"
    # the two servers listen on different ports: one slice each (the controller groups by port set)
    slices = [endpoint_slice("echo-1", "echo", "http", port_a, [(ip_a, True)]),
              endpoint_slice("echo-2", "echo", "http", port_b, [(ip_b, True)])]
    proxy._replace(SLICES_PATH, slices)
    seen = [get(f"http://{address}:{port}/") for _ in range(30)]
    assert set(seen) == {"a", "b"}, seen

    proxy._apply(SLICES_PATH, "MODIFIED", endpoint_slice("echo-1", "echo", "http", port_a, [(ip_a, False)]))
    assert {get(f"http://{address}:{port}/") for _ in range(20)} == {"b"}
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("service.proxy")]
    assert f"service.proxy ns=ns name=echo listen={address} ports=8080->{port} endpoints=http=0" in logged
    assert f"service.proxy endpoints ns=ns name=echo listen={address} endpoints=http=2" in logged
    assert logged[-1] == f"service.proxy endpoints ns=ns name=echo listen={address} endpoints=http=1"

    proxy._apply(SLICES_PATH, "DELETED", slices[1])  # no ready endpoint left: reset at once
    t0 = time.monotonic()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        get(f"http://{address}:{port}/")
    assert time.monotonic() - t0 < 1.0


def test_a_new_services_address_is_published_with_its_ports_bound(proxy: ServiceProxy,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader (a pod's service links, address() / port()) never sees a new Service's address without its ports:
    the listeners are published once bound (test_runtime_survives_apiserver_restart once read a port of None)."""
    seen_while_binding: list[object] = []
    real = services_mod._ServiceListeners.sync_ports

    def sync_ports(self: services_mod._ServiceListeners, wanted: dict[int, str]) -> None:
        seen_while_binding.append((proxy.address(*self.key), proxy.link_services(self.key[0])))
        real(self, wanted)

    monkeypatch.setattr(services_mod._ServiceListeners, "sync_ports", sync_ports)
    proxy._replace(SERVICES_PATH, [service("web", [{"name": "http", "port": 8081}])])
    assert seen_while_binding == [(None, [])]
    assert proxy.address("ns", "web") is not None and proxy.port("ns", "web", 8081) is not None


def test_proxy_links_only_its_namespace_and_releases_everything_on_stop(proxy: ServiceProxy) -> None:
    before = set(threading.enumerate())  # a session's process runtime may run its own proxy threads
    proxy._replace(SERVICES_PATH, [
        service("web", [{"name": "http", "port": 8081}]),
        service("peers", [{"name": "x", "port": 8082}], cluster_ip="None"),
        service("other", [{"port": 8083}], ns="elsewhere"),
    ])
    links = {svc["metadata"]["name"]: (host, ports) for svc, host, ports in proxy.link_services("ns")}
    assert set(links) == {"web"}
    address, ports = links["web"]
    port = ports[8081]
    assert port == proxy.port("ns", "web", 8081)
    assert proxy.address("elsewhere", "other") not in (None, address)
    # a listener exists (no endpoints: the connection is reset, possibly before connect() returns, not refused)
    with contextlib.suppress(ConnectionResetError):
        socket.create_connection((address, port), timeout=2).close()
    assert any(t.name.startswith("svc-ns/web") for t in threading.enumerate())
    proxy._apply(SERVICES_PATH, "DELETED", service("web", [{"name": "http", "port": 8081}]))
    assert proxy.address("ns", "web") is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, port), timeout=2).close()
    proxy.stop()
    assert not [t.name for t in threading.enumerate() if t not in before and t.name.startswith("svc-")]
    assert not (DEFAULT_LEASE_DIR / address).exists()
