"""The operator image installs weightsync without extras: no torch, numpy, xxhash or nixl. Its entry module
and everything the operator and the CRD models import must therefore work with those packages missing. A
subprocess makes them unimportable (sys.modules[name] = None) and imports every module of
weightsync.operator and weightsync.crds, then runs `weightsync-operator --help`."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
OPERATOR_PACKAGES = ("weightsync.operator", "weightsync.crds")


def agent_only_modules() -> list[str]:
    """Top-level import names of every distribution the agent/gdr extras add (torch, numpy, ...)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    dists = {re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")
             for extra in ("agent", "gdr") for req in extras[extra]}
    modules = {mod for mod, owners in importlib.metadata.packages_distributions().items()
               if any(o.lower().replace("_", "-") in dists for o in owners)}
    return sorted(modules | {d.replace("-", "_") for d in dists})


HARNESS = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    blocked, packages, entry = json.loads(sys.argv[1])
    for name in blocked:
        sys.modules[name] = None   # `import torch` now raises ImportError
    imported, failed = [], {}
    for name in entry:
        importlib.import_module(name)
    for pkg_name in packages:
        pkg = importlib.import_module(pkg_name)
        for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
            try:
                importlib.import_module(info.name)
                imported.append(info.name)
            except Exception as exc:
                failed[info.name] = repr(exc)
    print(json.dumps({"imported": imported, "failed": failed}))
""")


def run_blocked(blocked: list[str], packages: tuple[str, ...], entry: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HARNESS, json.dumps([blocked, list(packages), entry])],
                          capture_output=True, text=True, timeout=300)


def test_the_blocked_set_covers_the_agent_extras() -> None:
    blocked = agent_only_modules()
    for name in ("torch", "numpy", "xxhash", "nixl"):
        assert name in blocked, blocked


def test_operator_imports_without_torch() -> None:
    proc = run_blocked(agent_only_modules(), OPERATOR_PACKAGES, ["weightsync.operator.main"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["failed"] == {}, "operator modules that need an agent-only package:\n" + json.dumps(
        result["failed"], indent=1)
    assert "weightsync.operator.handlers" in result["imported"] and "weightsync.crds.models" in result["imported"]


def test_operator_help_runs_without_torch() -> None:
    code = (f"import sys\nfor n in {agent_only_modules()!r}: sys.modules[n] = None\n"
            "from weightsync.operator.main import main\nsys.argv = ['weightsync-operator', '--help']\nmain()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: weightsync-operator" in proc.stdout


def test_the_harness_catches_a_torch_import() -> None:
    """The same harness fails an agent module that imports torch: a torch import sneaking into the operator
    would be caught the same way."""
    proc = run_blocked(agent_only_modules(), ("weightsync.agent.transports",), [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.splitlines()[-1])["failed"]
    assert any("torch" in err for err in failed.values()), failed
    proc = run_blocked(agent_only_modules(), (), ["weightsync.agent.transfer.sync"])
    assert proc.returncode != 0 and "import of torch halted" in proc.stderr


def test_operator_dependencies_have_no_agent_packages() -> None:
    base = " ".join(PYPROJECT["project"]["dependencies"]).lower()
    for name in ("torch", "nixl", "numpy", "xxhash"):
        assert not re.search(rf"(^|\s){name}\b", base), f"{name} is a base dependency: it would land in the operator image"
