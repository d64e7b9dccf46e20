"""The two maps of the `weightsync` package agree: the installers' (pyproject.toml [tool.setuptools]
package-dir and packages) and the static tools' (weightsync/'s links to the top-level folders). And the
top-level operator/ folder, a namespace portion, never shadows the standard library's `operator`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "weightsync"


@pytest.fixture(scope="module")
def setuptools_config() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as f:
        config: dict[str, Any] = tomllib.load(f)["tool"]["setuptools"]
    return config


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools takes `package` from: its longest mapped prefix's folder, then the rest."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in package_dir:
            return REPO.joinpath(package_dir[prefix], *parts[n:])
    raise AssertionError(f"{package} is under no package-dir entry: {package_dir}")


def test_package_dir_equals_weightsync_links(setuptools_config: dict[str, Any]) -> None:
    package_dir: dict[str, str] = dict(setuptools_config["package-dir"])
    assert package_dir.pop("weightsync") == "weightsync"
    # each `weightsync.X` is the top-level folder X
    assert all(k.count(".") == 1 and v == k.split(".")[1] for k, v in package_dir.items()), package_dir
    links = {}
    for entry in PACKAGE.iterdir():
        if entry.is_symlink():
            assert os.readlink(entry) == f"../{entry.name}", f"{entry} -> {os.readlink(entry)}"
            assert entry.resolve() == REPO / entry.name and entry.resolve().is_dir(), entry
            links[f"weightsync.{entry.name}"] = entry.name
        else:
            # weightsync/ holds only the links and the top package's own files
            assert entry.name in ("__init__.py", "__pycache__"), f"{entry}: neither a link nor __init__.py"
    assert links == package_dir


def test_every_listed_package_is_a_folder(setuptools_config: dict[str, Any]) -> None:
    package_dir: dict[str, str] = setuptools_config["package-dir"]
    missing = [p for p in setuptools_config["packages"] if not _folder(p, package_dir).is_dir()]
    assert not missing, f"listed in [tool.setuptools] packages, but no such folder: {missing}"


def test_every_regular_package_is_listed(setuptools_config: dict[str, Any]) -> None:
    """setuptools does not discover packages under a remapped folder: a folder with an __init__.py that is
    not listed would be missing from the wheel (and from the images built from it)."""
    package_dir: dict[str, str] = setuptools_config["package-dir"]
    listed = set(setuptools_config["packages"])
    found = set()
    for name, folder in package_dir.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"folders with an __init__.py missing from [tool.setuptools] packages: " \
                                    f"{sorted(found - listed)}"


def test_import_operator_from_the_repository_root_is_the_standard_library() -> None:
    """With the repository root first on sys.path (`python -c` from it), `import operator` still loads the
    standard library's module: the project's operator/ has no __init__.py, so it is only a namespace portion
    and a regular module further down sys.path wins."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME")}
    code = ("import sys; pre = 'operator' in sys.modules; import operator; "
            "print(repr((pre, sys.path[0], operator.__file__)))")
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    preloaded, first, location = ast.literal_eval(proc.stdout.strip())
    # the check means something only if the root is on sys.path and `operator` was not imported at start-up
    assert first == "" and not preloaded, (first, preloaded)
    assert (REPO / "operator").is_dir() and not (REPO / "operator" / "__init__.py").exists()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(location).resolve() == stdlib / "operator.py", location
