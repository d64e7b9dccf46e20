"""Turn the pydantic models into the WeightSyncJob CustomResourceDefinition.

Pydantic emits JSON Schema (draft 2020-12) with `$defs`/`$ref`, `anyOf: [X, null]` for optional fields
and titles; the API server wants a *structural* OpenAPI v3 schema: every node typed, refs inlined, no
`additionalProperties: false` next to `properties`, no nulls. `to_structural` does that conversion and
nothing else, so the models stay the single source of truth.

Defaults: a field whose value comes from a `default_factory` (a nested object whose fields all have
defaults, e.g. `spec.transfer`) gets `default: {}`, so the API server materialises the nested defaults
when the user leaves the whole object out. An optional object defaulting to None (e.g.
`spec.transfer.deltaSync`) stays absent.
"""

from __future__ import annotations

from typing import Any

from weightsync.crds import contract
from weightsync.crds.k8s_schema import VERBATIM
from weightsync.crds.models import (
    JOB_NAME_MESSAGE,
    JOB_NAME_PATTERN,
    MAX_JOB_NAME_LENGTH,
    WeightSyncJobSpec,
    WeightSyncJobStatus,
)

# Keys copied unchanged from a pydantic schema node (everything else is dropped or rewritten).
_KEEP = (
    "type",
    "format",
    "description",
    "enum",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "nullable",
)
_VALIDATIONS = "x-kubernetes-validations"


class SchemaError(ValueError):
    """The models use a construct a structural schema cannot express; fix the model."""


def _deref(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline `$ref` (also the `allOf: [{$ref}]` form) into the node; sibling keys win, CEL rules add up."""
    ref = node.get("$ref")
    if ref is None and isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
        ref = node["allOf"][0].get("$ref")
    if ref is None:
        return node
    target = dict(defs[ref.rsplit("/", 1)[-1]])
    siblings = {k: v for k, v in node.items() if k not in ("$ref", "allOf")}
    merged = {**target, **siblings}
    rules = list(target.get(_VALIDATIONS, [])) + list(siblings.get(_VALIDATIONS, []))
    if rules:
        merged[_VALIDATIONS] = rules
    return merged


def _strip_null(node: dict[str, Any]) -> dict[str, Any]:
    """`anyOf: [X, {type: null}]` (pydantic's Optional) becomes X plus the node's own keys."""
    options = node.get("anyOf")
    if not isinstance(options, list):
        return node
    non_null = [o for o in options if o.get("type") != "null"]
    if len(non_null) != 1:
        raise SchemaError(f"union types cannot be expressed in a structural schema: {options!r}")
    rest = {k: v for k, v in node.items() if k != "anyOf"}
    return {**non_null[0], **rest}


def to_structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Convert one pydantic JSON-schema node (and its children) to a structural OpenAPI v3 node."""
    if node.get(VERBATIM):  # already structural (the Kubernetes PodTemplateSpec schema): kept as it is
        return {k: v for k, v in node.items() if k not in (VERBATIM, "title")}
    node = _strip_null(_deref(node, defs))
    node = _deref(node, defs)  # an Optional[Model] is a $ref inside anyOf
    out: dict[str, Any] = {}
    for key in _KEEP:
        if key in node and node[key] is not None:
            out[key] = node[key]
    if "const" in node and "enum" not in out:
        out["enum"] = [node["const"]]
    if "properties" in node:
        required = set(node.get("required", []))
        props: dict[str, Any] = {}
        for name, child in node["properties"].items():
            converted = to_structural(child, defs)
            resolved = _strip_null(_deref(child, defs))
            if (
                name not in required
                and "default" not in child
                and "default" not in resolved
                and converted.get("type") == "object"
                and "properties" in converted
                and not converted.get("required")
            ):
                converted["default"] = {}
            props[name] = converted
        out["properties"] = props
        out["type"] = "object"
    if "items" in node:
        out["items"] = to_structural(node["items"], defs)
        out["type"] = "array"
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
    if "type" not in out and not out.get("x-kubernetes-int-or-string") and not out.get(
        "x-kubernetes-preserve-unknown-fields"
    ):
        raise SchemaError(f"schema node has no type: {node!r}")
    if out.get("required") == []:
        del out["required"]
    return out


def model_schema(model: type[Any]) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a pydantic model (camelCase aliases)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return to_structural(raw, defs)


def printer_columns() -> list[dict[str, Any]]:
    """`kubectl get wsj` columns; Mode is the effective (Auto-resolved) transfer mode from the status."""

    def cond(type_: str) -> str:
        return f'.status.conditions[?(@.type=="{type_}")].status'

    return [
        {"name": "Placement", "type": "string", "jsonPath": ".spec.placement.mode",
         "description": "Colocated or Separated."},
        {"name": "Mode", "type": "string", "jsonPath": ".status.mode",
         "description": "Effective transfer mode (Auto resolved)."},
        {"name": "Trainer", "type": "integer", "jsonPath": ".status.trainerVersion",
         "description": "Newest version published by the trainer."},
        {"name": "Served", "type": "integer", "jsonPath": ".status.servedVersion",
         "description": "Lowest version served by a Ready inference replica."},
        {"name": "Synced", "type": "string", "jsonPath": cond(contract.COND_SYNCED),
         "description": "Every inference replica serves the trainer's newest version."},
        {"name": "Ready", "type": "string", "jsonPath": cond(contract.COND_READY),
         "description": "All owned pods exist and serving replicas are within maxStaleness."},
        {"name": "Paused", "type": "string", "jsonPath": cond(contract.COND_PAUSED),
         "description": "Generation is paused on every inference replica (spec.paused confirmed)."},
        {"name": "Degraded", "type": "string", "jsonPath": f'.status.conditions[?(@.type=="{contract.COND_DEGRADED}")].reason',
         "description": "The Degraded condition's reason (AsExpected when healthy)."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Requested", "type": "string", "jsonPath": ".spec.transfer.mode", "priority": 1,
         "description": "transfer.mode as written in the spec."},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.inference.replicas", "priority": 1,
         "description": "Desired inference replicas."},
        {"name": "Ready-Replicas", "type": "integer", "jsonPath": ".status.replicas.ready", "priority": 1,
         "description": "Inference replicas Ready."},
        {"name": "Replica-Versions", "type": "string", "jsonPath": ".status.replicaVersions",
         "priority": 1, "description": "The version each inference replica serves, in replica order (skew at a glance)."},
        {"name": "Committed", "type": "integer", "jsonPath": ".status.committedVersion", "priority": 1,
         "description": "updatePolicy.strategy Atomic: the version committed to every replica."},
    ]


def root_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the WeightSyncJob kind."""
    spec = model_schema(WeightSyncJobSpec)
    status = model_schema(WeightSyncJobStatus)
    return {
        "type": "object",
        "description": "WeightSyncJob declares trainer pods, inference engine replicas, their placement and how "
        "model weights move from the trainer to every inference replica after each optimizer step.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion: weightsync.io/v1alpha1."},
            "kind": {"type": "string", "description": "Kind: WeightSyncJob."},
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "description": f"Job name: a DNS-1035 label of at most {MAX_JOB_NAME_LENGTH} characters."}},
            },
            "spec": spec,
            "status": status,
        },
        _VALIDATIONS: [
            {
                "rule": f"!has(self.metadata.name) || (size(self.metadata.name) <= {MAX_JOB_NAME_LENGTH} && "
                f"self.metadata.name.matches('{JOB_NAME_PATTERN}'))",
                "fieldPath": ".metadata.name",
                "message": JOB_NAME_MESSAGE,
            }
        ],
    }


def crd() -> dict[str, Any]:
    """The complete CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": contract.CRD_NAME,
            "labels": {"app.kubernetes.io/name": "weightsync-operator", "app.kubernetes.io/part-of": "weightsync"},
        },
        "spec": {
            "group": contract.GROUP,
            "names": {
                "kind": contract.KIND,
                "listKind": f"{contract.KIND}List",
                "plural": contract.PLURAL,
                "singular": contract.SINGULAR,
                "shortNames": [contract.SHORT_NAME],
                "categories": ["weightsync"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": contract.VERSION,
                    "served": True,
                    "storage": True,
                    # scale: `kubectl scale wsj/NAME --replicas=N` and HPAs set spec.inference.replicas.
                    "subresources": {"status": {}, "scale": {
                        "specReplicasPath": ".spec.inference.replicas",
                        "statusReplicasPath": ".status.replicas.inference",
                        "labelSelectorPath": ".status.selector",
                    }},
                    "additionalPrinterColumns": printer_columns(),
                    "schema": {"openAPIV3Schema": root_schema()},
                }
            ],
        },
    }
