"""`weightsync-crds`: `print` is the generated CRD, the change list is readable and an RBAC refusal names
the missing permission. (The real apply against an API server: tests/integration/test_crd_upgrade_hook.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from weightsync.crds import contract
from weightsync.crds.generate import render
from weightsync.crds.install import _explain, changes, main

SCRIPT = Path(sys.executable).parent / "weightsync-crds"


def test_print_is_the_generated_crd() -> None:
    r = subprocess.run([str(SCRIPT), "print"], capture_output=True, text=True, check=True)
    assert r.stdout == render()
    assert f"name: {contract.CRD_NAME}" in r.stdout


def test_changes_name_added_removed_and_changed_paths() -> None:
    old = {"a": 1, "b": {"c": [1, {"d": "x"}]}, "gone": True}
    new = {"a": 2, "b": {"c": [1, {"d": "y", "e": 0}]}}
    assert changes(old, new) == [
        "spec.a: 1 -> 2", "spec.b.c[1].d: \"x\" -> \"y\"", "spec.b.c[1].e added", "spec.gone removed",
    ]
    assert changes(new, new) == []
    assert changes([1], [1, 2], "x") == ["x: [1] -> [1, 2]"]
    versions = changes([{"name": "v0", "served": True}, {"name": "v1", "x": 1}], [{"name": "v1", "x": 2}], "v")
    assert versions == ["v[name=v0] removed", "v[name=v1].x: 1 -> 2"]


def test_a_403_names_the_missing_verb_and_the_grant() -> None:
    body = json.dumps({"message": 'customresourcedefinitions.apiextensions.k8s.io "weightsyncjobs.weightsync.io" is '
                       'forbidden: User "system:serviceaccount:ops:hook" cannot patch resource '
                       '"customresourcedefinitions" in API group "apiextensions.k8s.io" at the cluster scope'})
    msg = _explain("PATCH", 403, "Forbidden", body.encode())
    assert "system:serviceaccount:ops:hook may not patch customresourcedefinitions/weightsyncjobs.weightsync.io" in msg
    assert "resourceNames [weightsyncjobs.weightsync.io]" in msg and "get, create, patch, update" in msg
    assert "422" not in _explain("PUT", 422, "Invalid", b'{"message": "spec.versions: Invalid value"}')
    assert "refused the generated CRD" in _explain("PUT", 422, "Invalid", b'{"message": "x"}')


def test_apply_without_credentials_fails_with_a_message(tmp_path, caplog) -> None:
    missing = tmp_path / "nope.kubeconfig"
    assert main(["apply", "--kubeconfig", str(missing)]) == 1
    assert "cannot apply weightsyncjobs.weightsync.io" in caplog.text
