"""Table-driven: invalid WeightSyncJobs are refused by the API server itself (no operator runs), with a
message that names the field. The table (tests/crds/invalid_cases.py) is shared with the pydantic mirror
test, so the operator's models refuse the same objects."""

from __future__ import annotations

import json
from typing import Any

import pytest
from api_helpers import kube_json, kubectl_ok, load_cases

pytestmark = pytest.mark.cluster

cases = load_cases()


def _name(case_id: str) -> str:
    return f"v-{case_id}"[:40].rstrip("-")


def test_table_has_at_least_twenty_kinds() -> None:
    assert len(cases.CASES) >= 20
    assert {c.kind for c in cases.CASES} >= {"enum", "bound", "required", "pattern", "CEL", "immutable"}


@pytest.mark.parametrize("case", cases.CREATE_CASES, ids=lambda c: c.id)
def test_invalid_create_is_refused_naming_the_field(case: Any, cluster: Any, api_ns: str) -> None:
    obj = case.build(_name(case.id))
    res = cluster.kubectl("create", "-n", api_ns, "-f", "-", input=json.dumps(obj), check=False)
    assert res.returncode != 0, f"{case.id}: the API server accepted an invalid object"
    message = res.stderr
    assert "is invalid" in message or "Invalid value" in message, message
    assert case.field in message, f"{case.id}: {case.field!r} not named in: {message}"
    if case.also:
        assert case.also in message, f"{case.id}: {case.also!r} not in: {message}"
    gone = cluster.kubectl("get", "wsj", obj["metadata"]["name"], "-n", api_ns, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


@pytest.mark.parametrize("case", cases.UPDATE_CASES, ids=lambda c: c.id)
def test_immutable_field_update_is_refused(case: Any, cluster: Any, api_ns: str) -> None:
    name = _name(case.id)
    kubectl_ok(cluster, "create", "-n", api_ns, "-f", "-", input=json.dumps(case.build(name)))
    stored = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    res = cluster.kubectl("replace", "-n", api_ns, "-f", "-", input=json.dumps(case.updated(stored)), check=False)
    assert res.returncode != 0, f"{case.id}: the API server accepted a change of an immutable field"
    assert case.field in res.stderr and "immutable" in res.stderr, res.stderr
    after = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    assert after["spec"] == stored["spec"]
    assert after["metadata"]["generation"] == stored["metadata"]["generation"]


def test_immutable_field_refused_through_server_side_apply(cluster: Any, api_ns: str) -> None:
    obj = cases.separated("v-ssa-immutable")
    kubectl_ok(cluster, "apply", "--server-side", "-n", api_ns, "-f", "-", input=json.dumps(obj))
    obj["spec"]["trainer"]["template"]["spec"]["containers"][0]["image"] = "example.com/trainer:2"
    res = cluster.kubectl("apply", "--server-side", "-n", api_ns, "-f", "-", input=json.dumps(obj), check=False)
    assert res.returncode != 0
    assert "spec.trainer.template is immutable" in res.stderr


@pytest.mark.parametrize(("label", "mutate"), cases.ALLOWED_UPDATES, ids=[n for n, _ in cases.ALLOWED_UPDATES])
def test_allowed_update_is_applied(label: str, mutate: Any, cluster: Any, api_ns: str) -> None:
    name = _name(f"ok-{label}")
    kubectl_ok(cluster, "create", "-n", api_ns, "-f", "-", input=json.dumps(cases.separated(name)))
    stored = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    wanted = json.loads(json.dumps(stored))
    mutate(wanted)
    kubectl_ok(cluster, "replace", "-n", api_ns, "-f", "-", input=json.dumps(wanted))
    after = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    for key, value in wanted["spec"].items():
        if isinstance(value, dict):
            assert value.items() <= after["spec"][key].items(), key
        else:
            assert after["spec"][key] == value, key
    assert after["metadata"]["generation"] == stored["metadata"]["generation"] + 1


def test_kubectl_scale_sets_inference_replicas_and_validation_still_applies(cluster: Any, api_ns: str) -> None:
    """The scale subresource (HPA-compatible): `kubectl scale wsj/NAME --replicas=N` sets
    spec.inference.replicas; the CRD's rules still refuse a value the schema refuses."""
    name = "v-scale"
    kubectl_ok(cluster, "create", "-n", api_ns, "-f", "-", input=json.dumps(cases.separated(name)))
    kubectl_ok(cluster, "scale", f"wsj/{name}", "-n", api_ns, "--replicas=3")
    after = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    assert after["spec"]["inference"]["replicas"] == 3
    scale = json.loads(kubectl_ok(cluster, "get", "--raw",
                                  f"/apis/weightsync.io/v1alpha1/namespaces/{api_ns}/weightsyncjobs/{name}/scale"))
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    bad = cluster.kubectl("scale", f"wsj/{name}", "-n", api_ns, "--replicas=5000", check=False)
    assert bad.returncode != 0 and "spec.inference.replicas" in bad.stderr, bad.stderr
    assert kube_json(cluster, "get", "wsj", name, "-n", api_ns)["spec"]["inference"]["replicas"] == 3


def test_printer_columns_show_paused_and_degraded(cluster: Any, api_ns: str) -> None:
    name = "v-columns"
    kubectl_ok(cluster, "create", "-n", api_ns, "-f", "-", input=json.dumps(cases.separated(name)))
    header = kubectl_ok(cluster, "get", "wsj", name, "-n", api_ns).splitlines()[0].split()
    assert header == ["NAME", "PLACEMENT", "MODE", "TRAINER", "SERVED", "SYNCED", "READY", "PAUSED", "DEGRADED", "AGE"]


def test_template_fields_are_documented_and_unknown_ones_refused(cluster: Any, api_ns: str) -> None:
    """Issue 16: the templates carry the full core/v1 schema: `kubectl explain` documents a container's
    image, `--validate=strict` refuses a typo inside a template (before: silently kept, then dropped), and
    the immutability rule still holds on the typed template."""
    explained = kubectl_ok(cluster, "explain", "weightsyncjobs.spec.inference.template.spec.containers.image")
    assert "FIELD: image <string>" in explained and "Container image name" in explained, explained
    name = "v-strict"
    obj = cases.separated(name)
    obj["spec"]["trainer"]["template"]["spec"]["containers"][0]["imagee"] = "typo"
    bad = cluster.kubectl("create", "--validate=strict", "-n", api_ns, "-f", "-", input=json.dumps(obj), check=False)
    assert bad.returncode != 0 and 'unknown field "spec.trainer.template.spec.containers[0].imagee"' in bad.stderr, \
        bad.stderr
    del obj["spec"]["trainer"]["template"]["spec"]["containers"][0]["imagee"]
    obj["spec"]["trainer"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": 2, "memory": "1Gi"}}
    kubectl_ok(cluster, "create", "--validate=strict", "-n", api_ns, "-f", "-", input=json.dumps(obj))
    stored = kube_json(cluster, "get", "wsj", name, "-n", api_ns)
    assert stored["spec"]["trainer"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "cpu": 2, "memory": "1Gi"}


def test_the_template_schema_snapshot_is_the_api_servers_own(cluster: Any) -> None:
    """crds/k8s/pod-template-spec.json converts from this kube-apiserver's own OpenAPI (the pinned release):
    a drift means `python -m weightsync.e2e.pod_schema --refresh` and `make crds`."""
    from weightsync.crds import k8s_schema

    doc = json.loads(kubectl_ok(cluster, "get", "--raw", "/openapi/v3/api/v1"))
    snapshot = json.loads(k8s_schema.SNAPSHOT.read_text())
    assert k8s_schema.convert(doc["components"]["schemas"]) == snapshot["schema"], (
        "the snapshot drifted from the API server's schema: run python -m weightsync.e2e.pod_schema --refresh")
    version = json.loads(kubectl_ok(cluster, "version", "-o", "json"))["serverVersion"]["gitVersion"]
    assert snapshot["kubernetesVersion"] == version
