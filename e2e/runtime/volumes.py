"""File payloads of configMap, secret, downwardAPI and projected volumes (pure).

A payload maps a path relative to the volume root to its bytes and mode; the AtomicWriter puts it on disk.
Missing sources that are not optional raise VolumeError (the kubelet's FailedMount: the pod waits).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync.e2e.runtime.envvars import (
    EnvError,
    Lookup,
    field_ref_value,
    resource_field_value,
)

JSON = dict[str, Any]
DEFAULT_MODE = 0o644
# (audience or None for the apiserver's default, expirationSeconds) -> a token for this pod
TokenSource = Callable[["str | None", int], str]


class VolumeError(Exception):
    """A volume cannot be populated yet (missing source, bad item): the pod's containers wait."""


@dataclass(frozen=True)
class FileEntry:
    data: bytes
    mode: int = DEFAULT_MODE


Payload = dict[str, FileEntry]


def _check_rel_path(path: str) -> str:
    parts = path.split("/")
    if path.startswith("/") or ".." in parts or not path or any(p.startswith("..") for p in parts):
        raise VolumeError(f"invalid volume item path {path!r}: must be relative without '..'")
    return path


def _keyed_payload(
    kind: str, source: JSON, obj: JSON | None, default_mode: int, what: str, name: str
) -> Payload:
    """configMap / secret volume (or projection): every key, or just `items` (key -> path, mode)."""
    optional = bool(source.get("optional"))
    if obj is None:
        if optional:
            return {}
        raise VolumeError(f'{what} "{name}" not found')
    if kind == "secrets":
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    else:
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    items = source.get("items")
    if not items:
        return {_check_rel_path(k): FileEntry(v, default_mode) for k, v in data.items()}
    payload: Payload = {}
    for item in items:
        key = item["key"]
        if key not in data:
            if optional:
                continue
            raise VolumeError(f"{what} {name} references non-existent key {key}")
        payload[_check_rel_path(item["path"])] = FileEntry(data[key], item.get("mode", default_mode))
    return payload


def configmap_payload(source: JSON, namespace: str, lookup: Lookup, default_mode: int | None = None) -> Payload:
    name = source.get("name", "")
    mode = source.get("defaultMode", DEFAULT_MODE) if default_mode is None else default_mode
    return _keyed_payload("configmaps", source, lookup("configmaps", namespace, name), mode, "configmap", name)


def secret_payload(source: JSON, namespace: str, lookup: Lookup, default_mode: int | None = None) -> Payload:
    name = source.get("secretName") or source.get("name", "")
    mode = source.get("defaultMode", DEFAULT_MODE) if default_mode is None else default_mode
    return _keyed_payload("secrets", source, lookup("secrets", namespace, name), mode, "secret", name)


def downward_payload(
    source: JSON, pod: JSON, pod_ip: str, host_ip: str, default_mode: int | None = None
) -> Payload:
    """downwardAPI items: fieldRef (incl. all labels / annotations) and resourceFieldRef."""
    mode = source.get("defaultMode", DEFAULT_MODE) if default_mode is None else default_mode
    payload: Payload = {}
    containers = {c["name"]: c for c in pod.get("spec", {}).get("containers") or []}
    for item in source.get("items") or []:
        path = _check_rel_path(item["path"])
        try:
            if "fieldRef" in item:
                value = field_ref_value(pod, item["fieldRef"]["fieldPath"], pod_ip, host_ip)
            elif "resourceFieldRef" in item:
                ref = item["resourceFieldRef"]
                container = containers.get(ref.get("containerName", ""), {})
                value = resource_field_value(container, ref["resource"], ref.get("divisor"))
            else:
                raise VolumeError(f"downwardAPI item {path!r} has neither fieldRef nor resourceFieldRef")
        except EnvError as exc:
            raise VolumeError(exc.message) from exc
        payload[path] = FileEntry(value.encode(), item.get("mode", mode))
    return payload


def projected_payload(
    source: JSON,
    pod: JSON,
    pod_ip: str,
    host_ip: str,
    lookup: Lookup,
    token: TokenSource,
) -> Payload:
    """projected: the union of its sources (secret, configMap, downwardAPI, serviceAccountToken)."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    mode = source.get("defaultMode", DEFAULT_MODE)
    payload: Payload = {}
    for src in source.get("sources") or []:
        if "secret" in src:
            payload.update(secret_payload(src["secret"], namespace, lookup, mode))
        elif "configMap" in src:
            payload.update(configmap_payload(src["configMap"], namespace, lookup, mode))
        elif "downwardAPI" in src:
            payload.update(downward_payload(src["downwardAPI"], pod, pod_ip, host_ip, mode))
        elif "serviceAccountToken" in src:
            sat = src["serviceAccountToken"]
            value = token(sat.get("audience") or None, int(sat.get("expirationSeconds") or 3600))
            payload[_check_rel_path(sat.get("path", "token"))] = FileEntry(value.encode(), mode)
        else:
            raise VolumeError(f"unsupported projected volume source {sorted(src)}")
    return payload


SA_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def kube_api_access_volume(name: str = "kube-api-access-runtime") -> JSON:
    """The projected volume the ServiceAccount admission plugin injects (used when a pod lacks one)."""
    return {
        "name": name,
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]
                    }
                },
            ],
        },
    }
