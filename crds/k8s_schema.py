"""The full core/v1 PodTemplateSpec schema for the CRD's pod templates, from the Kubernetes OpenAPI.

Why: with `x-kubernetes-preserve-unknown-fields` a typo inside a template (`imagee:`) was silently kept
and dropped later, and `kubectl explain` showed nothing below `containers.name`. With the real schema the
API server prunes nothing, `kubectl apply --validate=strict` refuses unknown fields, and `kubectl explain
wsj.spec.inference.template.spec.containers.image` documents every field.

The schema is a committed snapshot (`crds/k8s/pod-template-spec.json`) taken from a kube-apiserver's
`/openapi/v3/api/v1` and converted to a CRD structural schema (`convert`): references inlined, Quantity /
IntOrString as int-or-string, defaults dropped (an empty default object would add e.g. an empty probe to
every container), list-map keys kept (with the default or `required` they need), long descriptions cut,
and the template's metadata pruned to labels and annotations. `python -m weightsync.e2e.pod_schema --refresh`
retakes the snapshot from the local control plane's kube-apiserver (`make crds` then rebuilds the CRD); tests
check the snapshot converts from the pinned release and stays in the CRD. The API package never imports the
local cluster: the refresh lives in e2e/.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).resolve().parent / "k8s" / "pod-template-spec.json"
ROOT = "io.k8s.api.core.v1.PodTemplateSpec"
DESCRIPTION_LIMIT = 300  # characters: the full texts would make the CRD about 750 KB
VERBATIM = "x-weightsync-verbatim"  # tells crds.schema.to_structural to keep a node as it is
_KEEP_X = {"x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type",
           "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource"}


def _short(text: str) -> str:
    if len(text) <= DESCRIPTION_LIMIT:
        return text
    return text[:DESCRIPTION_LIMIT].rsplit(" ", 1)[0] + " ..."


def _convert(node: dict[str, Any], defs: dict[str, Any], stack: tuple[str, ...]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None and isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
        ref = node["allOf"][0].get("$ref")
    if ref is not None:
        name = str(ref).rsplit("/", 1)[-1]
        if name in stack:
            raise ValueError(f"recursive schema {' -> '.join((*stack, name))}: cannot be inlined")
        inlined = _convert(defs[name], defs, (*stack, name))
        if node.get("description"):
            inlined["description"] = _short(str(node["description"]))
        return inlined
    out: dict[str, Any] = {}
    if "oneOf" in node:  # Quantity and IntOrString: a number or a string
        out["x-kubernetes-int-or-string"] = True
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    for key, value in node.items():
        if key in ("oneOf", "default") or (key == "format" and value == "int-or-string"):
            continue
        if key.startswith("x-") and key not in _KEEP_X:
            continue
        if key == "description":
            out[key] = _short(str(value))
        elif key == "properties":
            out[key] = {k: _convert(v, defs, stack) for k, v in value.items()}
        elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = _convert(value, defs, stack)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _list_map_keys(node: Any) -> None:
    """A list-map key must be required or defaulted (a CRD rule): `protocol` defaults to TCP as in core/v1,
    the others (names) become required."""
    if isinstance(node, dict):
        if node.get("type") == "array" and node.get("x-kubernetes-list-map-keys"):
            item = node["items"]
            required = set(item.get("required", []))
            for key in node["x-kubernetes-list-map-keys"]:
                if key in required:
                    continue
                if key == "protocol":
                    item["properties"][key]["default"] = "TCP"
                else:
                    required.add(key)
            if required:
                item["required"] = sorted(required)
        for value in node.values():
            _list_map_keys(value)
    elif isinstance(node, list):
        for value in node:
            _list_map_keys(value)


def convert(components: dict[str, Any]) -> dict[str, Any]:
    """The CRD schema of a PodTemplateSpec from an OpenAPI v3 document's `components.schemas`."""
    schema = _convert(components[ROOT], components, (ROOT,))
    _list_map_keys(schema)
    schema["properties"]["metadata"] = {
        "type": "object",
        "description": "Labels and annotations copied onto every pod built from this template.",
        "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Pod labels."},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"},
                            "description": "Pod annotations."},
        },
    }
    return schema


def pod_template_schema() -> dict[str, Any]:
    """The template schema used in the CRD: the snapshot plus weightsync's own outline (a spec with 1 to 16
    named containers), marked verbatim for crds.schema."""
    snap = json.loads(SNAPSHOT.read_text())
    schema: dict[str, Any] = copy.deepcopy(snap["schema"])
    schema["required"] = ["spec"]
    spec = schema["properties"]["spec"]
    spec["required"] = sorted({*spec.get("required", []), "containers"})
    containers = spec["properties"]["containers"]
    containers["minItems"], containers["maxItems"] = 1, 16
    containers["description"] = ("The pod's containers (at least one); the agent sidecar is added by the "
                                 "operator. " + str(containers.get("description", "")))[:DESCRIPTION_LIMIT]
    name = containers["items"]["properties"]["name"]
    name["minLength"], name["maxLength"] = 1, 63
    schema[VERBATIM] = True
    return schema
