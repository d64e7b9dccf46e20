"""Helpers shared by the API tests (a module with a unique name: `conftest` cannot be imported reliably
when several test folders have one)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from weightsync.crds import contract

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / f"{contract.GROUP}_{contract.PLURAL}.yaml"


def load_cases() -> ModuleType:
    """tests/crds/invalid_cases.py: the invalid-object table shared with the pydantic mirror test."""
    name = "invalid_cases"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "crds" / "invalid_cases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def kube_json(cluster: Any, *args: str) -> dict[str, Any]:
    """`kubectl ... -o json` parsed."""
    return json.loads(kubectl_ok(cluster, *args, "-o", "json"))


def kubectl_ok(cluster: Any, *args: str, input: str | None = None) -> str:
    """Run kubectl and fail the test with its stderr (CalledProcessError hides it) when it fails."""
    res = cluster.kubectl(*args, input=input, check=False)
    assert res.returncode == 0, f"kubectl {' '.join(args)} failed (rc={res.returncode}): {res.stderr.strip()}"
    return str(res.stdout)
