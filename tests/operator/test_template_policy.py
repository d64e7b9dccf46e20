"""F6 of the hostile-input issue: the operator creates pods from the user's templates with its own rights,
so host access in a template (hostNetwork, hostPID, hostIPC, privileged, hostPath) and the agent's ports
are refused, naming the field; a cluster admin can allow host access per namespace. The same checks exist
as CEL for the chart's ValidatingAdmissionPolicy (tests/api/test_template_policy_admission.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from weightsync.crds import generate
from weightsync.crds.template_policy import CHECKS, admission_policy_validations, template_violations
from weightsync.operator.config import OperatorConfig
from weightsync.operator.placement import plan
from weightsync.operator.pods import TemplateError, build_pods

APP = {"name": "app", "image": "example.com/app:1"}

# (what the template asks for, the field the refusal must name, host access?)
HOSTILE: list[tuple[str, dict[str, Any], str, bool]] = [
    ("hostNetwork", {"hostNetwork": True}, "spec.hostNetwork", True),
    ("hostPID", {"hostPID": True}, "spec.hostPID", True),
    ("hostIPC", {"hostIPC": True}, "spec.hostIPC", True),
    ("privileged", {"containers": [APP, {**APP, "name": "p", "securityContext": {"privileged": True}}]},
     "spec.containers[1].securityContext.privileged", True),
    ("privileged-init", {"initContainers": [{**APP, "name": "i", "securityContext": {"privileged": True}}]},
     "spec.initContainers[0].securityContext.privileged", True),
    ("hostPath", {"volumes": [{"name": "ok", "emptyDir": {}}, {"name": "root", "hostPath": {"path": "/"}}]},
     "spec.volumes[1].hostPath", True),
    ("agent-port", {"containers": [{**APP, "ports": [{"containerPort": 8000}, {"containerPort": 47102}]}]},
     "spec.containers[0].ports[1].containerPort", False),
    ("agent-host-port", {"containers": [{**APP, "ports": [{"containerPort": 9000, "hostPort": 47100}]}]},
     "spec.containers[0].ports[0].hostPort", False),
]


def _template(extra: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"containers": [APP], **extra}}


@pytest.mark.parametrize(("case", "extra", "field", "host"), HOSTILE, ids=[h[0] for h in HOSTILE])
@pytest.mark.parametrize("role", ["trainer", "inference"])
def test_hostile_template_is_refused_naming_the_field(job, separated, cfg, case, extra, field, host, role) -> None:
    spec = separated(**{role: {"template": _template(extra)}})
    with pytest.raises(TemplateError) as err:
        build_pods(job, spec, plan(job.name, spec), cfg)
    assert f"spec.{role}.template.{field}" in str(err.value)
    assert ("allowHostAccessNamespaces" in str(err.value)) == host


@pytest.mark.parametrize(("case", "extra", "field", "host"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_allowed_namespace_gets_host_access_but_never_the_agent_ports(job, separated, cfg, case, extra, field,
                                                                     host) -> None:
    spec = separated(trainer={"template": _template(extra)})
    allowed = replace(cfg, host_access_namespaces=frozenset({job.namespace}))
    if host:
        pods = build_pods(job, spec, plan(job.name, spec), allowed)
        assert pods, "host access allowed in this namespace: the pods are built"
    else:
        with pytest.raises(TemplateError, match="agent"):
            build_pods(job, spec, plan(job.name, spec), allowed)
    other = replace(cfg, host_access_namespaces=frozenset({"somewhere-else"}))
    with pytest.raises(TemplateError):
        build_pods(job, spec, plan(job.name, spec), other)


def test_harmless_values_pass() -> None:
    t = _template({"hostNetwork": False, "hostPID": False,
                   "containers": [{**APP, "securityContext": {"privileged": False},
                                   "ports": [{"containerPort": 47099}, {"containerPort": 47103}]}],
                   "volumes": [{"name": "d", "emptyDir": {}}]})
    assert template_violations("trainer", t, allow_host_access=False) == []


def test_namespaces_come_from_the_chart_env() -> None:
    c = OperatorConfig.from_env({"WEIGHTSYNC_HOST_ACCESS_NAMESPACES": " infra, gpu-admin ,"})
    assert c.host_access_namespaces == frozenset({"infra", "gpu-admin"})
    assert OperatorConfig.from_env({}).host_access_namespaces == frozenset()


def test_admission_policy_has_one_validation_per_check_and_role() -> None:
    host, ports = admission_policy_validations(True), admission_policy_validations(False)
    assert len(host) + len(ports) == 2 * len(CHECKS)
    for v in host + ports:
        assert v["message"].startswith(("spec.trainer.template.spec.", "spec.inference.template.spec."))
        assert v["expression"].count("(") == v["expression"].count(")")


def test_chart_policy_file_is_generated_from_the_checks() -> None:
    path = generate.policy_target()
    assert json.loads(path.read_text()) == json.loads(generate.render_policy()), "run `make crds`"
