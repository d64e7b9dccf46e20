"""Operator configuration: one frozen object built from the environment (the Helm chart sets these) and
overridden by command-line flags, so builders take plain values and never read the environment."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from weightsync.crds import contract
from weightsync.crds.models import DEFAULT_RDMA_RESOURCE, RDMA_RESOURCE_PATTERN
from weightsync.crds.version_proof import MIN_KEY_BYTES

DEFAULT_AGENT_IMAGE = "ghcr.io/weightsync/weightsync-agent:0.1.0"


def _bool(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to a whole number or unset it") from None


def _selector(raw: str) -> dict[str, str]:
    """Parse `k=v,k2=v2` (the GPU node selector); an empty string means no node affinity."""
    out: dict[str, str] = {}
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(
                f"WEIGHTSYNC_GPU_NODE_SELECTOR entry {part!r} must be key=value (e.g. nvidia.com/gpu.present=true)"
            )
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


ENV_HOST_ACCESS_NAMESPACES = "WEIGHTSYNC_HOST_ACCESS_NAMESPACES"
ENV_OPERATOR_KEY_FILE = "WEIGHTSYNC_OPERATOR_KEY_FILE"
ENV_AGENT_METRICS_ALLOW_FROM = "WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM"
_PEER_KEYS = ("namespaceSelector", "podSelector")
_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _label_selector(where: str, sel: Any) -> dict[str, Any]:
    """Check one metav1.LabelSelector (matchLabels / matchExpressions; {} selects everything)."""
    if not isinstance(sel, dict):
        raise ValueError(f"{where} must be a label selector object, got {sel!r}")
    extra = sorted(set(sel) - {"matchLabels", "matchExpressions"})
    if extra:
        raise ValueError(f"{where} has unknown keys {extra}; a label selector has matchLabels and matchExpressions")
    labels = sel.get("matchLabels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError(f"{where}.matchLabels must map label names to string values, got {labels!r}")
    exprs = sel.get("matchExpressions", [])
    if not isinstance(exprs, list):
        raise ValueError(f"{where}.matchExpressions must be a list, got {exprs!r}")
    for i, ex in enumerate(exprs):
        w = f"{where}.matchExpressions[{i}]"
        if not isinstance(ex, dict) or not isinstance(ex.get("key"), str) or not ex["key"]:
            raise ValueError(f"{w} must be an object with a non-empty key, got {ex!r}")
        if ex.get("operator") not in _SELECTOR_OPERATORS:
            raise ValueError(f"{w}.operator must be one of {list(_SELECTOR_OPERATORS)}, got {ex.get('operator')!r}")
        values = ex.get("values", [])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"{w}.values must be a list of strings, got {values!r}")
        if sorted(set(ex) - {"key", "operator", "values"}):
            raise ValueError(f"{w} has unknown keys {sorted(set(ex) - {'key', 'operator', 'values'})}")
    return sel


def _metrics_peers(raw: str) -> tuple[dict[str, Any], ...]:
    """Parse WEIGHTSYNC_AGENT_METRICS_ALLOW_FROM: a JSON list of NetworkPolicy peers (namespaceSelector and/or
    podSelector) admitted to the agents' metrics port. Empty or unset: none (the port stays job-internal)."""
    if raw.strip() == "":
        return ()
    fix = "; fix the chart value agentMetrics.allowFrom"
    try:
        peers = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{ENV_AGENT_METRICS_ALLOW_FROM} is not valid JSON ({err}){fix}") from None
    if peers is None:
        return ()
    if not isinstance(peers, list):
        raise ValueError(f"{ENV_AGENT_METRICS_ALLOW_FROM} must be a JSON list of NetworkPolicy peers{fix}")
    out = []
    for i, peer in enumerate(peers):
        where = f"{ENV_AGENT_METRICS_ALLOW_FROM}[{i}]"
        if not isinstance(peer, dict) or not peer or set(peer) - set(_PEER_KEYS):
            raise ValueError(
                f"{where}={peer!r} must be an object with namespaceSelector and/or podSelector (nothing else){fix}"
            )
        try:
            out.append({k: _label_selector(f"{where}.{k}", peer[k]) for k in _PEER_KEYS if k in peer})
        except ValueError as err:
            raise ValueError(f"{err}{fix}") from None
    return tuple(out)


def read_operator_key(path: str) -> bytes | None:
    """The operator key from its file ("" = none configured); a configured but unusable file is an error."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as err:
        raise ValueError(f"{ENV_OPERATOR_KEY_FILE}={path}: cannot read the operator key: {err.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{ENV_OPERATOR_KEY_FILE}={path}: the operator key has {len(key)} bytes, at least "
                         f"{MIN_KEY_BYTES} are needed (the chart generates 64)")
    return key


@dataclass(frozen=True)
class OperatorConfig:
    """Everything the builders need beyond the WeightSyncJob itself."""

    agent_image: str = DEFAULT_AGENT_IMAGE
    agent_image_pull_policy: str = "IfNotPresent"
    agent_cpu_request: str = "100m"
    agent_memory_request: str = "256Mi"
    # GPUs of one GPU node: Colocated pods without DRA must request exactly this many (whole-node pods).
    node_gpu_count: int = 8
    gpu_resource: str = "nvidia.com/gpu"
    # Node labels a GPU pod must match (required node affinity); empty = no node affinity.
    gpu_node_selector: dict[str, str] = field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    # Auto transfer mode resolves to GDR for Separated jobs only when the cluster has RDMA.
    rdma_available: bool = False
    # The cluster's defaults for what a job may leave unset: the extended resource a GDR agent requests
    # (spec.transfer.rdmaResourceName) and the DRA DeviceClass (spec.placement.dra.deviceClassName; "" = none,
    # a Colocated job with `dra: {}` is then refused).
    rdma_resource_name: str = DEFAULT_RDMA_RESOURCE
    dra_device_class_name: str = ""
    # Periodic level-triggered resync of every known job (seconds); watch events trigger sooner.
    resync_seconds: float = 30.0
    # Events of one job within this window become one reconcile (and so at most one status write): the
    # agents of a job commit a version at about the same moment.
    batch_seconds: float = 0.05
    # Ports of the operator process itself.
    metrics_port: int = 8080
    health_port: int = 8081
    # Where agents push their reports (operator/reports.py): the listener's port (0: off) and the address
    # agents reach this replica at (the chart passes the pod IP). Off without an operator key (nothing
    # pushed could be checked) or without an address.
    report_port: int = 8082
    report_address: str = ""
    # This process's instance (random, set at start): in the report address, so that agents see a restarted
    # or new active operator, which holds none of their reports yet, and push theirs again.
    report_instance: str = ""
    # Server-side dry-run of the user's templates before pods are created.
    dry_run_templates: bool = True
    # NetworkPolicy peers (namespaceSelector / podSelector) that may reach the agents' metrics port (a
    # Prometheus); empty: the agent ports admit only the job's own pods.
    agent_metrics_allow_from: tuple[dict[str, Any], ...] = ()
    # Namespaces whose templates may ask for host access (chart templatePolicy.allowHostAccessNamespaces);
    # everywhere else such a template is refused (crds/template_policy.py).
    host_access_namespaces: frozenset[str] = frozenset()
    # The operator key (chart Secret, WEIGHTSYNC_OPERATOR_KEY_FILE): job tokens are derived from it, so the
    # operator can check the agents' version proofs without reading Secrets. None: random tokens, versions
    # on pods believed unchecked (development only; the operator warns at start).
    operator_key: bytes | None = field(default=None, repr=False)

    @property
    def report_url(self) -> str | None:
        """What agents are told to push their reports to (None: the listener is off)."""
        if not self.report_port or not self.report_address or self.operator_key is None:
            return None
        host = f"[{self.report_address}]" if ":" in self.report_address else self.report_address
        query = f"?instance={self.report_instance}" if self.report_instance else ""
        return f"http://{host}:{self.report_port}{contract.REPORT_PATH}{query}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> OperatorConfig:
        e = os.environ if env is None else env
        base = cls(
            agent_image=e.get("WEIGHTSYNC_AGENT_IMAGE") or DEFAULT_AGENT_IMAGE,
            agent_image_pull_policy=e.get("WEIGHTSYNC_AGENT_IMAGE_PULL_POLICY") or "IfNotPresent",
            agent_cpu_request=e.get("WEIGHTSYNC_AGENT_CPU_REQUEST") or "100m",
            agent_memory_request=e.get("WEIGHTSYNC_AGENT_MEMORY_REQUEST") or "256Mi",
            node_gpu_count=_int(e, "WEIGHTSYNC_NODE_GPU_COUNT", 8),
            gpu_resource=e.get("WEIGHTSYNC_GPU_RESOURCE") or "nvidia.com/gpu",
            gpu_node_selector=_selector(e.get("WEIGHTSYNC_GPU_NODE_SELECTOR", "nvidia.com/gpu.present=true")),
            rdma_available=_bool(e.get("WEIGHTSYNC_RDMA_AVAILABLE"), False),
            rdma_resource_name=e.get("WEIGHTSYNC_RDMA_RESOURCE") or DEFAULT_RDMA_RESOURCE,
            dra_device_class_name=(e.get("WEIGHTSYNC_DRA_DEVICE_CLASS") or "").strip(),
            resync_seconds=float(e.get("WEIGHTSYNC_RESYNC_SECONDS") or 30.0),
            batch_seconds=float(e.get("WEIGHTSYNC_BATCH_SECONDS") or 0.05),
            metrics_port=_int(e, "WEIGHTSYNC_METRICS_PORT", 8080),
            health_port=_int(e, "WEIGHTSYNC_HEALTH_PORT", 8081),
            report_port=_int(e, "WEIGHTSYNC_REPORT_PORT", 8082),
            report_address=(e.get("WEIGHTSYNC_REPORT_ADDRESS") or e.get("POD_IP") or "").strip(),
            dry_run_templates=_bool(e.get("WEIGHTSYNC_DRY_RUN_TEMPLATES"), True),
            agent_metrics_allow_from=_metrics_peers(e.get(ENV_AGENT_METRICS_ALLOW_FROM, "")),
            host_access_namespaces=frozenset(
                n.strip() for n in e.get(ENV_HOST_ACCESS_NAMESPACES, "").split(",") if n.strip()),
            operator_key=read_operator_key(e.get(ENV_OPERATOR_KEY_FILE, "")),
        )
        if base.node_gpu_count < 1:
            raise ValueError("WEIGHTSYNC_NODE_GPU_COUNT must be >= 1 (the GPUs of one GPU node)")
        if not re.match(RDMA_RESOURCE_PATTERN, base.rdma_resource_name):
            raise ValueError(
                f"WEIGHTSYNC_RDMA_RESOURCE={base.rdma_resource_name!r} is not an extended resource name "
                "<domain>/<name> (e.g. rdma/hca_shared_devices_a); fix the chart value cluster.rdmaResourceName"
            )
        return replace(base, **overrides) if overrides else base
