"""The generated CRD: structural, documented, defaults and CEL rules equal to the models' (no cluster)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from invalid_cases import colocated, separated

from weightsync.crds import contract, models
from weightsync.crds.schema import SchemaError, crd, to_structural

CRD = crd()
VERSION = CRD["spec"]["versions"][0]
ROOT = VERSION["schema"]["openAPIV3Schema"]
SPEC = ROOT["properties"]["spec"]
STATUS = ROOT["properties"]["status"]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


def at(path: str) -> dict[str, Any]:
    node = ROOT
    for part in path.split("."):
        node = node["items"] if part == "[]" else node["properties"][part]
    return node


def test_identity() -> None:
    assert CRD["metadata"]["name"] == contract.CRD_NAME == "weightsyncjobs.weightsync.io"
    spec = CRD["spec"]
    assert spec["group"] == "weightsync.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "WeightSyncJob" and spec["names"]["plural"] == "weightsyncjobs"
    assert spec["names"]["shortNames"] == ["wsj"]
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.inference.replicas", "statusReplicasPath": ".status.replicas.inference",
        "labelSelectorPath": ".status.selector"}}


def test_printer_columns() -> None:
    cols = [c for c in VERSION["additionalPrinterColumns"] if not c.get("priority")]
    assert [c["name"] for c in cols] == ["Placement", "Mode", "Trainer", "Served", "Synced", "Ready", "Paused",
                                         "Degraded", "Age"]
    by_name = {c["name"]: c["jsonPath"] for c in cols}
    assert by_name["Placement"] == ".spec.placement.mode"
    assert by_name["Mode"] == ".status.mode"
    assert by_name["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert by_name["Synced"] == '.status.conditions[?(@.type=="Synced")].status'
    for col in VERSION["additionalPrinterColumns"]:  # every column path exists in the schema
        path = col["jsonPath"].split("[")[0].lstrip(".")
        if not path.startswith("metadata"):
            at(path)


def _in_template(path: str) -> bool:
    """Inside a pod template: Kubernetes' own core/v1 schema (crds/k8s_schema.py), with maps and
    int-or-string quantities as core/v1 has them."""
    return ".template." in f"{path}."


def test_schema_is_structural() -> None:
    forbidden = {"$ref", "$defs", "anyOf", "allOf", "oneOf", "title", "additionalProperties", "const"}
    for path, node in walk(ROOT):
        bad = forbidden & node.keys()
        if _in_template(path):
            bad -= {"additionalProperties"}
            if node.get("x-kubernetes-int-or-string"):
                bad -= {"anyOf"}
        assert not bad, f"{path}: {bad}"
        typed = "type" in node or node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        assert typed, f"{path} has no type"
        if "required" in node:
            assert set(node["required"]) <= set(node.get("properties", {})), path


def test_every_field_is_documented() -> None:
    undocumented = [
        path for path, node in walk(SPEC, ".spec") if path and not _in_template(path) and not node.get("description")
    ] + [path for path, node in walk(STATUS, ".status") if path and not node.get("description")]
    assert undocumented == []


def test_transfer_fields() -> None:
    transfer = at("spec.transfer")
    assert transfer["default"] == {}
    props = transfer["properties"]
    assert props["mode"]["enum"] == ["Auto", "IPC", "NCCL", "GDR"] and props["mode"]["default"] == "Auto"
    assert (props["bucketSizeMB"]["minimum"], props["bucketSizeMB"]["maximum"]) == (1, 16384)
    assert props["verify"]["enum"] == ["None", "Checksum"]
    assert "default" not in props["deltaSync"], "an optional object must stay absent"


def test_int_or_string_and_templates() -> None:
    mu = at("spec.updatePolicy.maxUnavailable")
    assert mu["x-kubernetes-int-or-string"] is True and mu["default"] == "25%"
    assert "type" not in mu
    for role in ("trainer", "inference"):
        tpl = at(f"spec.{role}.template")
        assert "x-kubernetes-preserve-unknown-fields" not in tpl, "unknown template fields must be refused"
        assert tpl["required"] == ["spec"]
        assert set(tpl["properties"]["metadata"]["properties"]) == {"labels", "annotations"}
        containers = tpl["properties"]["spec"]["properties"]["containers"]
        assert containers["minItems"] == 1 and containers["maxItems"] <= 32
        assert containers["x-kubernetes-list-map-keys"] == ["name"]
        item = containers["items"]["properties"]
        assert item["image"]["type"] == "string" and item["image"]["description"]
        limits = item["resources"]["properties"]["limits"]["additionalProperties"]
        assert limits["x-kubernetes-int-or-string"] is True, "quantities take numbers and strings"
        ports = item["ports"]
        assert ports["items"]["properties"]["protocol"]["default"] == "TCP", "a list-map key needs a default"


def test_inference_replicas_in_status_are_an_atomic_list() -> None:
    """One managed field for the whole list instead of one per entry and field: half the API server's work
    per status write at 128 replicas (docs/performance.md). Only the operator writes status."""
    replicas = at("status.inferenceReplicas")
    assert replicas["x-kubernetes-list-type"] == "atomic" and "x-kubernetes-list-map-keys" not in replicas


def test_conditions_are_a_map_list() -> None:
    conds = at("status.conditions")
    assert conds["x-kubernetes-list-type"] == "map"
    assert conds["x-kubernetes-list-map-keys"] == ["type"]
    assert conds["maxItems"] <= 16
    item = conds["items"]
    assert set(item["required"]) == {"type", "status", "reason", "lastTransitionTime"}
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"


def _rules(path: str) -> list[str]:
    return [v["rule"] for v in at(path).get("x-kubernetes-validations", [])]


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("spec", models.WeightSyncJobSpec),
        ("spec.placement", models.Placement),
        ("spec.trainer", models.TrainerSpec),
        ("spec.inference", models.InferenceSpec),
        ("spec.inference.engine", models.EngineSpec),
    ],
)
def test_model_rules_are_in_the_crd(path: str, model: type[models._Model]) -> None:
    assert model.__rules__, "every listed model has cross-field rules"
    rules = at(path)["x-kubernetes-validations"]
    for rule in model.__rules__:
        assert rule.to_k8s() in rules


def test_immutable_fields() -> None:
    immutable = sorted(
        path
        for path, node in walk(SPEC, "spec")
        if "self == oldSelf" in [v["rule"] for v in node.get("x-kubernetes-validations", [])]
    )
    assert immutable == sorted([
        "spec.placement",
        "spec.transfer.mode",
        "spec.trainer.replicas",
        "spec.trainer.gpusPerPod",
        "spec.trainer.parallelism",
        "spec.trainer.template",
        "spec.inference.gpusPerReplica",
        "spec.inference.podsPerReplica",
        "spec.inference.parallelism",
        "spec.inference.engine.type",
        "spec.inference.template",
    ])
    for mutable in ("spec.inference.replicas", "spec.paused", "spec.updatePolicy", "spec.transfer.bucketSizeMB"):
        assert "self == oldSelf" not in _rules(mutable)


def test_rule_messages_name_a_field() -> None:
    for path, node in walk(ROOT):
        for v in node.get("x-kubernetes-validations", []):
            assert v["message"].startswith(("spec.", "metadata.")), (path, v["message"])


def test_strings_are_bounded_for_cel_cost() -> None:
    """CEL cost is estimated from maxLength / maxItems: every string and list in the spec is bounded
    (pod templates are preserved as-is and only compared with ==)."""
    for path, node in walk(SPEC, "spec"):
        if _in_template(path):
            continue  # core/v1's schema, compared only with == (the API server's estimate accepts it: tests/api)
        if node.get("type") == "string" and "enum" not in node:
            assert "maxLength" in node, path
        if node.get("type") == "array":
            assert "maxItems" in node, path


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does: fill absent properties that have a default,
    recursively, also inside defaulted objects."""
    if isinstance(value, dict) and "properties" in schema:
        for name, child in schema["properties"].items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = apply_defaults(child, value[name])
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


@pytest.mark.parametrize("base", [separated, colocated], ids=["separated", "colocated"])
def test_schema_defaults_equal_model_defaults(base) -> None:
    obj = base("wsj")
    for key in ("transfer",):
        obj["spec"].pop(key, None)
    obj["spec"]["trainer"].pop("parallelism")
    obj["spec"]["trainer"]["parallelism"] = {"tensor": 1, "pipeline": 1, "data": 8 if base is separated else 16}
    obj["spec"]["inference"].pop("parallelism")
    obj["spec"]["inference"]["gpusPerReplica"] = 1 if base is separated else 2
    defaulted = apply_defaults(ROOT, copy.deepcopy(obj))
    assert defaulted["spec"] == models.WeightSyncJob.from_k8s(obj).to_dict()["spec"]


def test_converter_refuses_unions() -> None:
    with pytest.raises(SchemaError, match="union"):
        to_structural({"anyOf": [{"type": "integer"}, {"type": "string"}]}, {})
