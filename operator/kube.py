"""A thin dict-in, dict-out client over the official kubernetes ApiClient.

The builders produce plain manifests (dicts); this module sends them as-is, so there is no typed-model
round trip that could drop fields the user put into a pod template. Only the kinds the operator owns
are mapped: adding a kind is one line in RESOURCES.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from weightsync.crds import contract
from weightsync.operator.metrics import API_REQUESTS

log = logging.getLogger(__name__)

Obj = dict[str, Any]


@dataclass(frozen=True)
class ResourceInfo:
    api_version: str
    plural: str
    namespaced: bool = True

    def base(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"


RESOURCES: dict[str, ResourceInfo] = {
    "Pod": ResourceInfo("v1", "pods"),
    "Service": ResourceInfo("v1", "services"),
    "ConfigMap": ResourceInfo("v1", "configmaps"),
    "Secret": ResourceInfo("v1", "secrets"),
    "ServiceAccount": ResourceInfo("v1", "serviceaccounts"),
    "Event": ResourceInfo("v1", "events"),
    "Role": ResourceInfo("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ResourceInfo("rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ResourceInfo("networking.k8s.io/v1", "networkpolicies"),
    "ResourceClaimTemplate": ResourceInfo("resource.k8s.io/v1", "resourceclaimtemplates"),
    contract.KIND: ResourceInfo(contract.API_VERSION, contract.PLURAL),
    # kopf's peering objects (multi-replica operators).
    "KopfPeering": ResourceInfo("kopf.dev/v1", "kopfpeerings"),
    "ClusterKopfPeering": ResourceInfo("kopf.dev/v1", "clusterkopfpeerings", namespaced=False),
}


class KubeError(Exception):
    """An API error with the status code and the server's message (never the request body)."""

    def __init__(self, status: int, reason: str, message: str, body: Obj | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def invalid(self) -> bool:
        return self.status in (400, 403, 422)

    @property
    def forbidden_by_rbac(self) -> bool:
        """A 403 from the authorizer (`User "..." cannot VERB resource "R" ...`), not from admission
        (PodSecurity and webhooks also answer 403, with another message): the operator lacks a permission."""
        return self.status == 403 and " cannot " in self.message


def _error(exc: ApiException) -> KubeError:
    body: Obj = {}
    message = str(exc.reason or "")
    if exc.body:
        try:
            body = json.loads(exc.body)
            message = str(body.get("message") or message)
        except (ValueError, TypeError):
            message = str(exc.body)[:500]
    return KubeError(int(exc.status or 0), str(body.get("reason") or exc.reason or ""), message, body)


class Kube:
    """Synchronous CRUD on the kinds in RESOURCES; every call returns the server's JSON as a dict."""

    def __init__(self, api_client: k8s_client.ApiClient | None = None, request_timeout: float = 30.0) -> None:
        self.api = api_client or k8s_client.ApiClient()
        self.timeout = request_timeout

    @classmethod
    def from_environment(cls, request_timeout: float = 30.0) -> Kube:
        """In-cluster service account when running in a pod, else $KUBECONFIG / ~/.kube/config."""
        try:
            k8s_config.load_incluster_config()
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()
        conf = k8s_client.Configuration.get_default_copy()
        # One long-lived connection per watch (8 kinds per namespace) plus concurrent pod creates and patches:
        # the default (5 x CPUs) would open and throw away connections all the time.
        conf.connection_pool_maxsize = max(int(conf.connection_pool_maxsize or 0), 64)
        return cls(k8s_client.ApiClient(conf), request_timeout)

    # --- plumbing ---------------------------------------------------------------------------------------
    def _path(self, kind: str, namespace: str | None, name: str | None = None, sub: str | None = None,
              all_namespaces: bool = False) -> str:
        info = RESOURCES[kind]
        path = info.base()
        if info.namespaced and not (all_namespaces and namespace is None and name is None):
            if not namespace:
                raise ValueError(f"{kind} is namespaced: a namespace is required")
            path += f"/namespaces/{namespace}"
        path += f"/{info.plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        verb: str = "",
        kind: str = "",
    ) -> Obj:
        API_REQUESTS.labels(verb or method.lower(), kind).inc()
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            method_, url, hdrs, body_, post = self.api.param_serialize(
                method, path, query_params=query or [], header_params=headers, body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(method_, url, hdrs, body_, post, _request_timeout=self.timeout)
            raw = resp.read()
        except ApiException as exc:
            raise _error(exc) from None
        if not 200 <= int(resp.status) <= 299:
            raise _error(ApiException(status=resp.status, reason=resp.reason, body=raw.decode(errors="replace") if raw else None))
        return json.loads(raw) if raw else {}

    # --- verbs ------------------------------------------------------------------------------------------
    def get(self, kind: str, namespace: str | None, name: str) -> Obj:
        return self._call("GET", self._path(kind, namespace, name), verb="get", kind=kind)

    def get_or_none(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self.get(kind, namespace, name)
        except KubeError as err:
            if err.not_found:
                return None
            raise

    def list(self, kind: str, namespace: str | None, label_selector: Mapping[str, str] | None = None) -> list[Obj]:
        query = []
        if label_selector:
            query.append(("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(label_selector.items()))))
        out = self._call("GET", self._path(kind, namespace), query=query, verb="list", kind=kind)
        return list(out.get("items") or [])

    def list_page(self, kind: str, namespace: str | None, label_selector: str = "", limit: int = 500,
                  cont: str = "") -> Obj:
        """One page of a LIST (namespace None: every namespace) as the server sent it (items plus metadata.resourceVersion / continue): what
        an informer needs to start a watch where the list ended."""
        query = [("limit", str(limit))]
        if label_selector:
            query.append(("labelSelector", label_selector))
        if cont:
            query.append(("continue", cont))
        return self._call("GET", self._path(kind, namespace, all_namespaces=True), query=query, verb="list", kind=kind)

    def watch(self, kind: str, namespace: str | None, resource_version: str, label_selector: str = "",
              timeout_seconds: int = 300, on_open: Any = None) -> Iterator[Obj]:
        """Watch events ({type, object}) from RESOURCE_VERSION, with bookmarks, until the server closes the
        stream (after about TIMEOUT_SECONDS). ON_OPEN gets the open response (so another thread can close
        it to stop the watch). A 410 Gone arrives as an ERROR event, as the API server sends it."""
        query = [("watch", "true"), ("allowWatchBookmarks", "true"), ("resourceVersion", resource_version),
                 ("timeoutSeconds", str(timeout_seconds))]
        if label_selector:
            query.append(("labelSelector", label_selector))
        API_REQUESTS.labels("watch", kind).inc()
        headers = {"Accept": "application/json"}
        try:
            method_, url, hdrs, body_, post = self.api.param_serialize(
                "GET", self._path(kind, namespace, all_namespaces=True), query_params=query, header_params=headers,
                auth_settings=["BearerToken"],
            )
            resp = self.api.call_api(method_, url, hdrs, body_, post,
                                     _request_timeout=(self.timeout, timeout_seconds + 30))
        except ApiException as exc:
            raise _error(exc) from None
        raw = resp.response
        try:
            if not 200 <= int(resp.status) <= 299:
                data = raw.read()
                raise _error(ApiException(status=resp.status, reason=resp.reason,
                                          body=data.decode(errors="replace") if data else None))
            if on_open is not None:
                on_open(raw)
            buf = b""
            for chunk in raw.stream(None, decode_content=True):  # None: each chunk as it arrives
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
            if buf.strip():
                yield json.loads(buf)
        finally:
            raw.release_conn()

    def create(self, obj: Obj, dry_run: bool = False) -> Obj:
        kind = obj["kind"]
        ns = obj.get("metadata", {}).get("namespace")
        query = [("dryRun", "All")] if dry_run else []
        return self._call("POST", self._path(kind, ns), body=obj, query=query, verb="create", kind=kind)

    def patch(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        patch: Obj,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> Obj:
        ctype = {
            "merge": "application/merge-patch+json",
            "strategic": "application/strategic-merge-patch+json",
            "json": "application/json-patch+json",
        }[patch_type]
        return self._call("PATCH", self._path(kind, namespace, name, subresource), body=patch, content_type=ctype,
                          verb="patch", kind=kind)

    def delete(self, kind: str, namespace: str | None, name: str, uid: str | None = None) -> bool:
        """Delete; False when it was already gone. `uid` guards against deleting a newer namesake."""
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", self._path(kind, namespace, name), body=body, verb="delete", kind=kind)
        except KubeError as err:
            if err.not_found or err.conflict:
                return False
            raise
        return True
