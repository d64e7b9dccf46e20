"""What a WeightSyncJob's pod templates may not ask for: host access and the agent's ports.

The operator builds pods from the user's templates with its own ServiceAccount, so a template that asks
for `hostNetwork`, `hostPID`, `hostIPC`, a `privileged` container or a `hostPath` volume would get host
access through the operator that its author may not have been allowed to create directly. Each check is
written twice, like the CRD rules (crds/models.py `Rule`): a CEL expression for the API server (the chart's
ValidatingAdmissionPolicy, so `kubectl apply` refuses the job naming the field) and a Python predicate the
operator checks again before it creates a pod (a cluster without the policy, or a job stored before it).

Two groups:

* host access: refused unless the job's namespace is allowed by the cluster admin (Helm value
  `templatePolicy.allowHostAccessNamespaces`, passed to the operator as WEIGHTSYNC_HOST_ACCESS_NAMESPACES);
* the agent's ports (47100-47102): refused everywhere, the agent shares the pod's network namespace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from weightsync.crds import contract

PORT_LOW, PORT_HIGH = min(contract.AGENT_PORTS), max(contract.AGENT_PORTS)
ROLES = ("trainer", "inference")
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
HOST_ACCESS_HOW_TO_ALLOW = (
    "host access is refused by weightsync's template policy; a cluster admin can allow it for this namespace "
    "with the Helm value templatePolicy.allowHostAccessNamespaces"
)
PORTS_WHY = (f"ports {PORT_LOW}-{PORT_HIGH} are the injected agent's (control, metrics, transport) in the pod's "
             "shared network namespace; use another port")

PodSpec = dict[str, Any]


@dataclass(frozen=True)
class TemplateCheck:
    """One refusal: FIELD (relative to `template.spec`, `[*]` for every list item) is found by FIND in a pod
    spec (the paths of the offending items) and, for the API server, by CEL over the variable `p`, the
    template's pod spec (true means allowed)."""

    field: str
    cel: str
    find: Callable[[PodSpec], list[str]]
    host_access: bool

    @property
    def why(self) -> str:
        return HOST_ACCESS_HOW_TO_ALLOW if self.host_access else PORTS_WHY

    def message(self, role: str) -> str:
        return f"spec.{role}.template.spec.{self.field}: {self.why}"


def _flag(key: str) -> Callable[[PodSpec], list[str]]:
    return lambda p: [key] if p.get(key) is True else []


def _containers(p: PodSpec) -> Iterator[tuple[str, int, dict[str, Any]]]:
    for kind in CONTAINER_LISTS:
        items = p.get(kind)
        for i, c in enumerate(items if isinstance(items, list) else []):
            if isinstance(c, dict):
                yield kind, i, c


def _privileged(p: PodSpec) -> list[str]:
    return [f"{k}[{i}].securityContext.privileged" for k, i, c in _containers(p)
            if isinstance(c.get("securityContext"), dict) and c["securityContext"].get("privileged") is True]


def _host_path(p: PodSpec) -> list[str]:
    vols = p.get("volumes")
    return [f"volumes[{i}].hostPath" for i, v in enumerate(vols if isinstance(vols, list) else [])
            if isinstance(v, dict) and "hostPath" in v]


def _agent_ports(p: PodSpec) -> list[str]:
    out = []
    for k, i, c in _containers(p):
        ports = c.get("ports")
        for j, port in enumerate(ports if isinstance(ports, list) else []):
            for key in ("containerPort", "hostPort"):
                n = port.get(key) if isinstance(port, dict) else None
                if isinstance(n, int) and PORT_LOW <= n <= PORT_HIGH:
                    out.append(f"{k}[{i}].ports[{j}].{key}")
    return out


def _all_containers(cond: str) -> str:
    """CEL: COND (over `c`) holds for every container of every list present in `p`."""
    return " && ".join(f"(!has(p.{k}) || p.{k}.all(c, {cond}))" for k in CONTAINER_LISTS)


def _port_ok(key: str) -> str:
    return f"(!has(x.{key}) || x.{key} < {PORT_LOW} || x.{key} > {PORT_HIGH})"


CHECKS: tuple[TemplateCheck, ...] = (
    TemplateCheck("hostNetwork", "!has(p.hostNetwork) || p.hostNetwork != true", _flag("hostNetwork"), True),
    TemplateCheck("hostPID", "!has(p.hostPID) || p.hostPID != true", _flag("hostPID"), True),
    TemplateCheck("hostIPC", "!has(p.hostIPC) || p.hostIPC != true", _flag("hostIPC"), True),
    TemplateCheck("containers[*].securityContext.privileged",
                  _all_containers("!has(c.securityContext) || !has(c.securityContext.privileged) || "
                                  "c.securityContext.privileged != true"),
                  _privileged, True),
    TemplateCheck("volumes[*].hostPath", "!has(p.volumes) || p.volumes.all(v, !has(v.hostPath))", _host_path, True),
    TemplateCheck("containers[*].ports[*].containerPort",
                  _all_containers(f"!has(c.ports) || c.ports.all(x, {_port_ok('containerPort')} && "
                                  f"{_port_ok('hostPort')})"),
                  _agent_ports, False),
)


def template_violations(role: str, template: dict[str, Any], *, allow_host_access: bool) -> list[str]:
    """Every refused field of one role's template, as `spec.<role>.template.spec.<path>: <why>`."""
    spec = template.get("spec") if isinstance(template, dict) else None
    if not isinstance(spec, dict):
        return []
    out = []
    for check in CHECKS:
        if check.host_access and allow_host_access:
            continue
        out += [f"spec.{role}.template.spec.{path}: {check.why}" for path in check.find(spec)]
    return out


def admission_policy_validations(host_access: bool) -> list[dict[str, str]]:
    """The ValidatingAdmissionPolicy `validations` of one group (host access, or the agent's ports), for
    both roles; each message names the field. The chart ships them (files/template-policy.json)."""
    out = []
    for role in ROLES:
        for check in CHECKS:
            if check.host_access != host_access:
                continue
            # `p` is the template's pod spec; a job without the template is left to the CRD schema.
            expr = (f"!has(object.spec.{role}) || !has(object.spec.{role}.template) || "
                    f"!has(object.spec.{role}.template.spec) || "
                    f"[object.spec.{role}.template.spec].all(p, {check.cel})")
            out.append({"expression": expr, "message": check.message(role), "reason": "Forbidden"})
    return out


def chart_policy_file() -> dict[str, Any]:
    """The content of helm/weightsync-operator/files/template-policy.json."""
    return {"hostAccess": admission_policy_validations(True), "agentPorts": admission_policy_validations(False)}
