"""The import contracts (pyproject.toml [tool.importlinter], `make lint`) hold, and each kind can fail.

lint-imports runs on a copy of the package (conftest.py) with the repository's pyproject.toml as its
configuration: the copy as it is keeps every contract; one bad import added to it breaks the contract that
forbids it, and the report names the import.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"


@pytest.fixture
def lint_imports(python_in: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[[Path], subprocess.CompletedProcess[str]]:
    """lint_imports(root): `lint-imports pyproject.toml` on the `weightsync` found in ROOT."""

    def run(root: Path) -> subprocess.CompletedProcess[str]:
        # lint-imports puts its working directory first on sys.path: ROOT's copy is the one analysed
        return python_in(root, "-c", LINT_IMPORTS, "--no-cache", "--no-logo", str(REPO / "pyproject.toml"))

    return run


def broken(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The names of the contracts lint-imports reported BROKEN."""
    return re.findall(r"^(.+?) BROKEN(?: \(.*\))?$", proc.stdout, flags=re.MULTILINE)


def contract_name(config: dict[str, Any], contract_id: str) -> str:
    (name,) = [c["name"] for c in config["contracts"] if c["id"] == contract_id]
    return str(name)


def test_the_copy_is_what_is_analysed(package_copy: Path, package_location: Callable[[Path], list[str]]) -> None:
    where = package_location(package_copy)
    assert where == [str(package_copy.resolve() / "weightsync"), str(package_copy.resolve() / "weightsync" / "operator")]


def test_the_package_as_it_is_keeps_every_contract(
        package_copy: Path, lint_imports: Callable[[Path], subprocess.CompletedProcess[str]],
        importlinter_config: dict[str, Any]) -> None:
    proc = lint_imports(package_copy)
    kept = len(importlinter_config["contracts"])
    assert proc.returncode == 0 and f"Contracts: {kept} kept, 0 broken." in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize(("module", "source", "contract_id", "reported"), [
    # the operator importing the agent's entry point
    ("weightsync.operator._fixture_upward", "import weightsync.agent.main", "operator-not-agent",
     "weightsync.operator._fixture_upward -> weightsync.agent.main (l.3)"),
    # an engine adapter importing the operator (inside a function: it counts too)
    ("weightsync.agent.engines._fixture_operator", "def late() -> None:\n    import weightsync.operator.main",
     "agent-not-operator", "weightsync.agent.engines._fixture_operator -> weightsync.operator.main (l.4)"),
    # the API contract importing the agent
    ("weightsync.crds._fixture_agent", "from weightsync.agent import config", "crds-alone",
     "weightsync.crds._fixture_agent -> weightsync.agent.config (l.3)"),
    # the plan (bottom layer) importing a role (a layer above it)
    ("weightsync.agent.plan._fixture_upward", "from weightsync.agent.transfer import fetch", "agent-layers",
     "weightsync.agent.plan._fixture_upward -> weightsync.agent.transfer.fetch (l.3)"),
])
def test_one_bad_import_breaks_its_contract(
        package_copy: Path, add_module: Callable[[str, str], Path],
        lint_imports: Callable[[Path], subprocess.CompletedProcess[str]], importlinter_config: dict[str, Any],
        module: str, source: str, contract_id: str, reported: str) -> None:
    add_module(module, source)
    proc = lint_imports(package_copy)
    assert proc.returncode != 0, proc.stdout
    assert contract_name(importlinter_config, contract_id) in broken(proc), proc.stdout
    assert reported in proc.stdout, proc.stdout


def test_a_new_agent_module_must_be_placed_in_a_layer(
        package_copy: Path, add_module: Callable[[str, str], Path],
        lint_imports: Callable[[Path], subprocess.CompletedProcess[str]], importlinter_config: dict[str, Any]) -> None:
    add_module("weightsync.agent._fixture_unplaced", "")
    proc = lint_imports(package_copy)
    assert contract_name(importlinter_config, "agent-layers") in broken(proc), proc.stdout
    assert "- weightsync.agent._fixture_unplaced" in proc.stdout, proc.stdout
