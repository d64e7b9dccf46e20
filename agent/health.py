"""/healthz and /metrics over HTTP on the agent's metrics port (kubelet probes, Prometheus scrapes)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from weightsync.agent.wire.limits import ConnectionLimiter

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]


def _handler(registry: CollectorRegistry, health: HealthFn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # an idle or slow client is dropped, its thread freed

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/readyz"):
                try:
                    ok, detail = health()
                except Exception as exc:  # a broken health function is itself unhealthy
                    ok, detail = False, {"error": f"{type(exc).__name__}: {exc}"}
                body = json.dumps({"ok": ok, **detail}, default=str).encode()
                self._send(200 if ok else 503, body, "application/json")
            else:
                self._send(404, b"not found: use /healthz or /metrics\n", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http %s", format % args)

    return Handler


# A request must arrive (and its reply drain) within this many seconds, or the connection is closed.
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 32
MAX_CONNECTIONS_PER_PEER = 4


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, but at most MAX_CONNECTIONS of them (MAX_CONNECTIONS_PER_PEER per client
    address), each closed after REQUEST_TIMEOUT_S idle: a flood of idle connections from one client can
    neither exhaust threads nor keep the kubelet's readiness probe (another address) out."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 limiter: ConnectionLimiter) -> None:
        self.limiter = limiter
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.limiter.acquire(str(client_address[0])):
            log.debug("http.reject peer=%s reason=connection limit", client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.limiter.release(str(client_address[0]))
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.limiter.release(str(client_address[0]))


class HealthServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, health: HealthFn) -> None:
        self.limiter = ConnectionLimiter(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER)
        self.server = _BoundedHTTPServer((host, port), _handler(registry, health), self.limiter)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="health-http", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health/metrics listening port=%s", self.port)
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
