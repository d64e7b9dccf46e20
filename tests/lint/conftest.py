"""Fixtures of the import-graph checks: a copy of the `weightsync` package that a test may break on purpose.

The import contracts (pyproject.toml [tool.importlinter]) and the cycle check (test_import_cycles.py) are
proven able to fail by running them on a copy with one bad import added: the copy is a plain tree of the
package's Python files under tmp_path/weightsync/ (weightsync/'s links resolved), and a check run with that
directory as its working directory and only PYTHONPATH entry analyses the copy, not the repository's
editable install (`package_location` says which one a run finds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "weightsync"
#: The package's folders behind weightsync/'s links (pyproject.toml [tool.setuptools] package-dir).
SUBPACKAGES = ("agent", "crds", "operator", "e2e")

PythonIn = Callable[..., subprocess.CompletedProcess[str]]


def _python_only(directory: str, names: list[str]) -> set[str]:
    """copytree's filter: Python files and the folders that may hold them (no caches, data or scripts)."""
    return {n for n in names
            if n == "__pycache__" or n.startswith(".")
            or (not n.endswith(".py") and not os.path.isdir(os.path.join(directory, n)))}


def _python_in(root: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with ROOT as the working directory and the only PYTHONPATH entry: ROOT/weightsync is
    the `weightsync` found (both come before site-packages' editable finder on sys.path)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("PYTHONSAFEPATH", None)  # the working directory stays on sys.path, as lint-imports puts it
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="session")
def importlinter_config() -> dict[str, Any]:
    """pyproject.toml's [tool.importlinter]: the root packages and the contracts."""
    with (REPO / "pyproject.toml").open("rb") as f:
        config: dict[str, Any] = tomllib.load(f)["tool"]["importlinter"]
    return config


@pytest.fixture(scope="session")
def python_in() -> PythonIn:
    """python_in(root, *args): a Python process that finds the `weightsync` under ROOT (REPO: the checkout's)."""
    return _python_in


@pytest.fixture(scope="session")
def package_location() -> Callable[[Path], list[str]]:
    """package_location(root): the folders `weightsync` and its namespace portion weightsync.operator are
    found in by a process run in ROOT, links resolved."""

    def where(root: Path) -> list[str]:
        proc = _python_in(root, "-c", "import importlib.util, json, os; print(json.dumps([os.path.realpath(p) "
                          "for name in ('weightsync', 'weightsync.operator') "
                          "for p in importlib.util.find_spec(name).submodule_search_locations]))")
        assert proc.returncode == 0, proc.stderr
        locations: list[str] = json.loads(proc.stdout)
        return locations

    return where


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """tmp_path, with weightsync/__init__.py and the four subpackages' Python files in tmp_path/weightsync/."""
    target = tmp_path / "weightsync"
    target.mkdir()
    shutil.copy2(PACKAGE / "__init__.py", target / "__init__.py")
    for name in SUBPACKAGES:
        shutil.copytree((PACKAGE / name).resolve(), target / name, ignore=_python_only)
    return tmp_path


@pytest.fixture
def add_module(package_copy: Path) -> Callable[[str, str], Path]:
    """add_module("weightsync.operator._fixture_x", "import ..."): one more module in the copy."""

    def add(module: str, source: str) -> Path:
        path = package_copy.joinpath(*module.split(".")).with_suffix(".py")
        assert path.parent.is_dir(), path
        path.write_text(f'"""A fixture of tests/lint: {module}."""\n\n{source}\n')
        return path

    return add
