"""A small JSON client for the handful of API calls the process runtime makes.

Why not the generated client: the runtime needs raw dicts (camelCase, unknown fields kept), exact patch
content types (strategic merge on pods/status so foreign conditions survive) and line-by-line watches;
`requests` with the kubeconfig's credentials gives all of that in a few lines and is thread-safe per
session-per-thread use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import requests
from kubernetes import config as kube_config
from kubernetes.client import Configuration

log = logging.getLogger(__name__)

JSON = dict[str, Any]
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


class ApiError(Exception):
    """A non-2xx answer from the apiserver; `status` is the HTTP code (0 for a connection failure)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ApiEndpoint:
    """Where the apiserver is and how to authenticate to it (from a kubeconfig)."""

    server: str
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    bearer: str | None
    verify: bool

    @property
    def host(self) -> str:
        return urlparse(self.server).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parsed = urlparse(self.server)
        return parsed.port or (443 if parsed.scheme == "https" else 80)

    def ca_pem(self) -> bytes:
        """The cluster CA the in-cluster clients must trust (empty when the kubeconfig has none)."""
        return Path(self.ca_file).read_bytes() if self.ca_file else b""


def endpoint_from_kubeconfig(path: str) -> ApiEndpoint:
    """Load a kubeconfig file (certificate or token auth) into an ApiEndpoint."""
    cfg = Configuration()
    kube_config.load_kube_config(config_file=path, client_configuration=cfg)
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    if auth and not auth.lower().startswith("bearer "):
        auth = f"Bearer {auth}"
    return ApiEndpoint(
        server=cfg.host.rstrip("/"),
        ca_file=cfg.ssl_ca_cert,
        cert_file=cfg.cert_file,
        key_file=cfg.key_file,
        bearer=auth,
        verify=bool(cfg.verify_ssl),
    )


class KubeClient:
    """GET/LIST/WATCH/PATCH/POST/DELETE with JSON bodies; one requests.Session per thread."""

    def __init__(self, endpoint: ApiEndpoint, timeout_s: float = 15.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = False  # REQUESTS_CA_BUNDLE / proxies from the environment must not apply
            ep = self.endpoint
            if ep.cert_file and ep.key_file:
                session.cert = (ep.cert_file, ep.key_file)
            session.verify = (ep.ca_file or True) if ep.verify else False
            if ep.bearer:
                session.headers["Authorization"] = ep.bearer
            session.headers["User-Agent"] = "weightsync-process-runtime"
            self._local.session = session
        return session

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout_s: float | None = None,
    ) -> JSON:
        url = self.endpoint.server + path
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            resp = self._session().request(
                method, url, data=data, params=params, headers=headers, timeout=timeout_s or self.timeout_s
            )
        except requests.RequestException as exc:
            raise ApiError(0, f"{method} {path}: {exc}") from exc
        if resp.status_code >= 300:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            raise ApiError(resp.status_code, f"{method} {path}: {message}")
        if not resp.content:
            return {}
        try:
            return dict(resp.json())
        except ValueError:  # /readyz, /healthz answer plain text
            return {"text": resp.text}

    def get(self, path: str, **params: Any) -> JSON:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: JSON) -> JSON:
        return self.request("POST", path, body=body)

    def patch(self, path: str, body: JSON, content_type: str = STRATEGIC) -> JSON:
        return self.request("PATCH", path, body=body, content_type=content_type)

    def delete(self, path: str, body: JSON | None = None) -> JSON:
        return self.request("DELETE", path, body=body)

    def watch(
        self, path: str, params: dict[str, Any], timeout_s: int, on_open: Callable[[requests.Response], None] | None = None
    ) -> Iterator[JSON]:
        """Yield watch events ({type, object}) until the server closes the stream.

        `on_open` gets the streaming response first, so another thread can end a blocked read (abort_watch).
        """
        query = dict(params, watch="true", timeoutSeconds=str(timeout_s), allowWatchBookmarks="true")
        try:
            resp = self._session().get(
                self.endpoint.server + path, params=query, stream=True, timeout=(10, timeout_s + 30)
            )
        except requests.RequestException as exc:
            raise ApiError(0, f"WATCH {path}: {exc}") from exc
        if on_open is not None:
            on_open(resp)
        with resp:
            if resp.status_code >= 300:
                raise ApiError(resp.status_code, f"WATCH {path}: {resp.text[:500]}")
            try:
                for line in resp.iter_lines():
                    if line:
                        yield json.loads(line)
            except (requests.RequestException, ValueError) as exc:
                raise ApiError(0, f"WATCH {path} interrupted: {exc}") from exc


def abort_watch(resp: requests.Response) -> None:
    """End a watch stream another thread is blocked reading: shut its socket down (a close alone would not
    wake the reader), then close the response."""
    conn = getattr(resp.raw, "connection", None)
    sock = getattr(conn, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        resp.close()


def pod_path(namespace: str, name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}" + (f"/{sub}" if sub else "")
