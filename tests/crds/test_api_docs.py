"""Drift: docs/api-reference.md must equal the reference generated from the models, and it must cover
every field of the CRD schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from weightsync.crds import docs
from weightsync.crds.schema import crd

REPO = Path(__file__).resolve().parents[2]


def _crd_schema() -> dict[str, Any]:
    schema: dict[str, Any] = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_checked_in_reference_matches_the_models() -> None:
    path = docs.target(REPO)
    assert path.exists(), f"{path} missing: run `make docs`"
    expected = docs.render()
    assert path.read_text() == expected, (
        f"{path} is stale (the models changed): run `make docs` and commit it\n{docs.diff(path, expected)}"
    )


def test_every_spec_and_status_field_of_the_crd_has_a_row() -> None:
    text = docs.target(REPO).read_text()
    rows = set(docs.iter_rows(text))
    schema = _crd_schema()
    spec_fields = docs.field_paths(schema, "spec")
    assert len(spec_fields) > 20  # the walk really descended into the spec
    missing = [p for p in spec_fields + docs.field_paths(schema, "status") if f"`{p}`" not in rows]
    assert not missing, f"fields of the CRD schema missing from {docs.DOC_RELPATH}: {missing}; run `make docs`"


def test_immutable_fields_and_cel_messages_are_rendered() -> None:
    text = docs.render()
    schema = _crd_schema()

    def walk(node: dict[str, Any]) -> None:
        for rule in node.get("x-kubernetes-validations") or []:
            if rule["rule"] != docs.IMMUTABLE_RULE:
                assert rule["message"] in text, rule
        for child in (node.get("properties") or {}).values():
            walk(child)
        if isinstance(node.get("items"), dict):
            walk(node["items"])

    walk(schema)
    assert "self == oldSelf" in text


def test_render_is_deterministic() -> None:
    assert docs.render() == docs.render()


def test_check_mode_reports_drift(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "weightsync.crds.docs", "--root", str(tmp_path)]
    stale = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=False)
    assert stale.returncode == 1  # nothing there yet
    assert "make docs" in stale.stderr
    subprocess.run(cmd, check=True, capture_output=True)
    assert docs.target(tmp_path).read_text() == docs.render()
    ok = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
