"""mypy, as `make lint` runs it, sees across the project's packages: an import of `weightsync.*` is the
project's own module, so a type error across packages is reported rather than hidden behind `Any`.

The fixtures under fixtures/ are checked one by one with the repository's configuration (pyproject.toml
[tool.mypy], the one `make lint` uses) from the repository root: a deliberate cross-package error fails, the
same import with the right type passes, and an agent-side module sees the CRD models and its own
configuration as their real classes. The fixtures are neither in mypy's `files` nor collected by pytest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"

MypyRun = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def mypy(tmp_path_factory: pytest.TempPathFactory) -> MypyRun:
    """mypy(*fixtures): `python -m mypy --config-file pyproject.toml FIXTURES` in the repository root, with
    one cache shared by this module's runs (the first one analyses pydantic and the CRD models cold)."""
    cache = tmp_path_factory.mktemp("mypy-cache")
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "MYPY_CACHE_DIR")}

    def run(*names: str) -> subprocess.CompletedProcess[str]:
        paths = [str((FIXTURES / name).relative_to(REPO)) for name in names]
        return subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--cache-dir", str(cache), *paths],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=540, check=False,
        )

    return run


def _unresolved(out: str) -> list[str]:
    """Lines saying a module was not found: the checks below mean nothing if `weightsync.*` did not resolve."""
    return [line for line in out.splitlines() if "import-not-found" in line or "import-untyped" in line
            or "Cannot find implementation or library stub" in line]


def test_make_lint_checks_the_weightsync_package_with_pyproject_config() -> None:
    """The fixtures' resolution is the lint's: `make lint` runs mypy with no arguments (pyproject.toml's
    [tool.mypy], found from the repository root), whose `files` is the linked `weightsync` package."""
    with (REPO / "pyproject.toml").open("rb") as f:
        config = tomllib.load(f)["tool"]["mypy"]
    assert config["files"] == ["weightsync"]
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert recipe, "no lint target in the Makefile"
    mypy_lines = [line.strip() for line in recipe.group(1).splitlines() if "mypy" in line]
    assert mypy_lines == ["$(VPY) -m mypy"], mypy_lines


def test_a_type_error_across_packages_fails(mypy: MypyRun) -> None:
    proc = mypy("cross_package_error.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert not _unresolved(out), out
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, out
    assert errors[0].startswith("tests/lint/fixtures/cross_package_error.py:7: error: Incompatible types in "
                                'assignment (expression has type "str", variable has type "int")'), out


def test_the_same_import_with_the_right_type_passes(mypy: MypyRun) -> None:
    proc = mypy("cross_package_ok.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_agent_side_module_sees_the_real_classes(mypy: MypyRun) -> None:
    proc = mypy("agent_reveals.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not _unresolved(out), out
    revealed = re.findall(r'Revealed type is "([^"]+)"', proc.stdout)
    assert revealed == ["weightsync.crds.models.WeightSyncJobSpec", "weightsync.crds.topology.Topology"], out
