"""F6 of the hostile-input issue, at the API server: the chart's ValidatingAdmissionPolicies (rendered by
`helm template` from helm/weightsync-operator, validations generated from crds/template_policy.py) make
`kubectl apply --dry-run=server` refuse every hostile pod template, naming the field, except host access
in a namespace the admin listed in templatePolicy.allowHostAccessNamespaces; the agent's ports are refused
there too. The real kube-apiserver evaluates the CEL; no operator runs."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from api_helpers import REPO, kubectl_ok, load_cases

from weightsync.e2e.binaries import find_binary

pytestmark = pytest.mark.cluster

cases = load_cases()
CHART = REPO / "helm" / "weightsync-operator"
APP = {"name": "app", "image": "example.com/app:1"}

# (case, what the template asks for, the field the refusal names, host access?)
HOSTILE: list[tuple[str, dict[str, Any], str, bool]] = [
    ("hostNetwork", {"hostNetwork": True}, "template.spec.hostNetwork", True),
    ("hostPID", {"hostPID": True}, "template.spec.hostPID", True),
    ("hostIPC", {"hostIPC": True}, "template.spec.hostIPC", True),
    ("privileged", {"containers": [{**APP, "securityContext": {"privileged": True}}]},
     "template.spec.containers[*].securityContext.privileged", True),
    ("privileged-init", {"initContainers": [{**APP, "name": "i", "securityContext": {"privileged": True}}]},
     "template.spec.containers[*].securityContext.privileged", True),
    ("hostPath", {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, "template.spec.volumes[*].hostPath",
     True),
    ("agent-port", {"containers": [{**APP, "ports": [{"containerPort": 47101}]}]},
     "template.spec.containers[*].ports[*].containerPort", False),
]


def _job(name: str, role: str, extra: dict[str, Any]) -> dict[str, Any]:
    obj = cases.separated(name)
    obj["spec"][role]["template"] = {"spec": {"containers": [APP], **extra}}
    return obj


def _dry_run(cluster: Any, ns: str, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=json.dumps(obj),  # type: ignore[no-any-return]
                           check=False)


@pytest.fixture(scope="module")
def allowed_ns(cluster: Any, crd: str) -> Iterator[str]:
    name = f"wsj-hostok-{uuid.uuid4().hex[:6]}"
    kubectl_ok(cluster, "create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def policy(cluster: Any, api_ns: str, allowed_ns: str) -> Iterator[list[str]]:
    """The chart's policy objects only (helm template), applied to the cluster; removed afterwards."""
    out = subprocess.run([str(find_binary("helm")), "template", "wstest", str(CHART), "--kube-version", "1.34.4",
                          "--set", f"templatePolicy.allowHostAccessNamespaces={{{allowed_ns}}}"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    objs = [o for o in yaml.safe_load_all(out) if o and o["kind"].startswith("ValidatingAdmissionPolicy")]
    assert len(objs) == 4, [o["kind"] for o in objs]  # two policies, two bindings
    kubectl_ok(cluster, "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    names = [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in objs]
    # A new policy takes effect once the API server's informer has it: wait until a hostile object is refused.
    deadline = time.monotonic() + 60
    probe = _job("v-probe", "trainer", {"hostNetwork": True})
    while _dry_run(cluster, api_ns, probe).returncode == 0:
        assert time.monotonic() < deadline, "the template policy did not take effect within 60s"
        time.sleep(0.5)
    yield names
    for n in names:
        cluster.kubectl("delete", n, "--ignore-not-found", check=False)


@pytest.mark.parametrize(("case", "extra", "field", "host"), HOSTILE, ids=[h[0] for h in HOSTILE])
@pytest.mark.parametrize("role", ["trainer", "inference"])
def test_hostile_template_is_refused_by_the_api_server_naming_the_field(
        cluster: Any, api_ns: str, policy: list[str], case: str, extra: dict[str, Any], field: str, host: bool,
        role: str) -> None:
    res = _dry_run(cluster, api_ns, _job(f"v-{case.lower()}", role, extra))
    assert res.returncode != 0, f"{case}: the API server accepted a hostile template"
    assert f"spec.{role}.{field}" in res.stderr, res.stderr
    assert "denied request" in res.stderr, res.stderr


@pytest.mark.parametrize(("case", "extra", "field", "host"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_allowed_namespace_takes_host_access_but_not_the_agent_ports(
        cluster: Any, allowed_ns: str, policy: list[str], case: str, extra: dict[str, Any], field: str,
        host: bool) -> None:
    res = _dry_run(cluster, allowed_ns, _job(f"v-{case.lower()}", "trainer", extra))
    if host:
        assert res.returncode == 0, res.stderr
    else:
        assert res.returncode != 0 and f"spec.trainer.{field}" in res.stderr, res.stderr


def test_a_plain_template_passes(cluster: Any, api_ns: str, policy: list[str]) -> None:
    res = _dry_run(cluster, api_ns, _job("v-plain", "trainer", {"hostNetwork": False}))
    assert res.returncode == 0, res.stderr
