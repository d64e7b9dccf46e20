"""Container environment the way the kubelet builds it: envFrom, env, valueFrom refs and $(VAR) expansion.

Pure functions: the caller passes the pod, its IPs and a lookup for ConfigMaps / Secrets.
"""

from __future__ import annotations

import base64
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

JSON = dict[str, Any]
# (kind "configmaps" | "secrets", namespace, name) -> the object, or None when it does not exist.
Lookup = Callable[[str, str, str], "JSON | None"]

_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class EnvError(Exception):
    """The environment cannot be built yet (missing Secret key, bad fieldPath...): kubelet reason + message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def field_ref_value(pod: JSON, field_path: str, pod_ip: str, host_ip: str) -> str:
    """The downward-API value of `field_path` (the fieldRef paths the kubelet supports)."""
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple: dict[str, str] = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "") or "default",
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if field_path in simple:
        return simple[field_path]
    match = _FIELD_LABEL.match(field_path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if field_path in ("metadata.labels", "metadata.annotations"):
        return format_key_values(meta.get(field_path.split(".")[1]) or {})
    raise EnvError("CreateContainerConfigError", f"unsupported fieldRef fieldPath {field_path!r}")


def format_key_values(values: Mapping[str, str]) -> str:
    """The downward-API file format for all labels / annotations: sorted `key="value"` lines."""
    return "\n".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(values.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def resource_field_value(container: JSON, resource: str, divisor: str | None) -> str:
    """resourceFieldRef: a container's request / limit in units of `divisor` (rounded up, like the kubelet).

    An unset limit falls back to the host's capacity (the kubelet uses the node allocatable).
    """
    from kubernetes.utils import parse_quantity

    section, _, name = resource.partition(".")
    if section not in ("limits", "requests") or not name:
        raise EnvError("CreateContainerConfigError", f"unsupported resourceFieldRef resource {resource!r}")
    raw = ((container.get("resources") or {}).get(section) or {}).get(name)
    if raw is None:
        if name == "cpu":
            raw = str(os.cpu_count() or 1)
        elif name == "memory":
            raw = str(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        else:
            raw = "0"
    value = parse_quantity(str(raw)) / parse_quantity(divisor or "1")
    return str(math.ceil(value))


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined vars are replaced, undefined refs kept, `$$` is a literal `$`."""

    def repl(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_REF.sub(repl, value)


def _decoded(obj: JSON, kind: str) -> dict[str, str]:
    if kind == "secrets":
        return {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (obj.get("data") or {}).items()}
    data = dict(obj.get("data") or {})
    for k, v in (obj.get("binaryData") or {}).items():
        data[k] = base64.b64decode(v).decode("utf-8", "replace")
    return data


def _key_ref(ref: JSON, kind: str, namespace: str, lookup: Lookup) -> str | None:
    name = ref.get("name", "")
    key = ref.get("key", "")
    optional = bool(ref.get("optional"))
    obj = lookup(kind, namespace, name)
    what = "secret" if kind == "secrets" else "configmap"
    if obj is None:
        if optional:
            return None
        raise EnvError("CreateContainerConfigError", f'{what} "{name}" not found')
    data = _decoded(obj, kind)
    if key not in data:
        if optional:
            return None
        raise EnvError("CreateContainerConfigError", f"couldn't find key {key} in {what} {namespace}/{name}")
    return data[key]


def container_env(
    pod: JSON,
    container: JSON,
    pod_ip: str,
    host_ip: str,
    lookup: Lookup,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The container's declared environment on top of `base` (service env, PATH...), kubelet order."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    env: dict[str, str] = dict(base or {})
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source or "secretRef" in source:
            kind = "configmaps" if "configMapRef" in source else "secrets"
            ref = source.get("configMapRef") or source.get("secretRef") or {}
            obj = lookup(kind, namespace, ref.get("name", ""))
            if obj is None:
                if ref.get("optional"):
                    continue
                what = "configmap" if kind == "configmaps" else "secret"
                raise EnvError("CreateContainerConfigError", f'{what} "{ref.get("name", "")}" not found')
            for key, value in _decoded(obj, kind).items():
                env[prefix + key] = value
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        resolved: str | None
        if "fieldRef" in source:
            resolved = field_ref_value(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            target = container
            if ref.get("containerName"):
                every = (pod.get("spec", {}).get("containers") or []) + (
                    pod.get("spec", {}).get("initContainers") or []
                )
                target = next((c for c in every if c.get("name") == ref["containerName"]), container)
            resolved = resource_field_value(target, ref["resource"], ref.get("divisor"))
        elif "secretKeyRef" in source:
            resolved = _key_ref(source["secretKeyRef"], "secrets", namespace, lookup)
        elif "configMapKeyRef" in source:
            resolved = _key_ref(source["configMapKeyRef"], "configmaps", namespace, lookup)
        else:
            raise EnvError("CreateContainerConfigError", f"env {name}: unsupported valueFrom {sorted(source)}")
        if resolved is not None:
            env[name] = resolved
    return env


def service_env(api_host: str, api_port: int) -> dict[str, str]:
    """The `kubernetes` Service env the kubelet injects, pointing at the real apiserver."""
    return {
        "KUBERNETES_SERVICE_HOST": api_host,
        "KUBERNETES_SERVICE_PORT": str(api_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
        "KUBERNETES_PORT": f"tcp://{api_host}:{api_port}",
        "KUBERNETES_PORT_443_TCP": f"tcp://{api_host}:{api_port}",
        "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_443_TCP_ADDR": api_host,
        "KUBERNETES_PORT_443_TCP_PORT": str(api_port),
    }


def env_var_name(service_name: str) -> str:
    """The kubelet's service env prefix: upper case, '-' -> '_' (`demo-rl-inference` -> `DEMO_RL_INFERENCE`)."""
    return service_name.upper().replace("-", "_")


def has_cluster_ip(service: JSON) -> bool:
    """The kubelet's IsServiceIPSet: a ClusterIP that is neither empty nor `None` (headless)."""
    ip = (service.get("spec") or {}).get("clusterIP") or ""
    return ip not in ("", "None")


def service_link_env(services: Sequence[tuple[JSON, str, Mapping[int, int]]]) -> dict[str, str]:
    """The kubelet's service links for (Service, host, port map) triples: `<NAME>_SERVICE_HOST`,
    `<NAME>_SERVICE_PORT` (first port), `<NAME>_SERVICE_PORT_<PORT>` per named port and the Docker-link
    `<NAME>_PORT*` vars.

    `host` and the port map (Service port -> the port to connect to; a port not in it is used as is) stand in
    for `spec.clusterIP` and the Service's ports (the process runtime's proxy for the Service). The Docker-link
    names keep the Service's port number (`<NAME>_PORT_8001_TCP`), their values the port to connect to.
    Services without a ClusterIP (headless, ExternalName) and without ports get nothing, like the kubelet.
    """
    env: dict[str, str] = {}
    for service, host, mapped in sorted(services, key=lambda link: link[0].get("metadata", {}).get("name", "")):
        ports = (service.get("spec") or {}).get("ports") or []
        if not has_cluster_ip(service) or not ports:
            continue
        prefix = env_var_name(service["metadata"]["name"])

        def to(port: Mapping[str, Any], mapped: Mapping[int, int] = mapped) -> str:
            return str(mapped.get(int(port["port"]), port["port"]))

        env[f"{prefix}_SERVICE_HOST"] = host
        env[f"{prefix}_SERVICE_PORT"] = to(ports[0])
        for port in ports:
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{env_var_name(port['name'])}"] = to(port)
        for i, port in enumerate(ports):
            proto = str(port.get("protocol") or "TCP")
            url = f"{proto.lower()}://{host}:{to(port)}"
            if i == 0:
                env[f"{prefix}_PORT"] = url
            each = f"{prefix}_PORT_{port['port']}_{proto.upper()}"
            env[each] = url
            env[f"{each}_PROTO"] = proto.lower()
            env[f"{each}_PORT"] = to(port)
            env[f"{each}_ADDR"] = host
    return env
