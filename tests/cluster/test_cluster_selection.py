"""E2E_CLUSTER: which cluster the e2e environment uses (local | kind | existing), a pure function of the
environment, and how start_environment attaches to it. No cluster is started or contacted here."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from weightsync.e2e.cluster import ClusterError
from weightsync.e2e.environment import (
    CLUSTER_EXISTING,
    CLUSTER_KIND,
    CLUSTER_LOCAL,
    ClusterSelection,
    ClusterSelectionError,
    kind_kubeconfig,
    select_cluster,
    start_environment,
)
from weightsync.e2e.pytest_plugin import KIND_SKIP_REASON, kind_selected

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ClusterSelection(CLUSTER_LOCAL)),
        ({"E2E_CLUSTER": "local"}, ClusterSelection(CLUSTER_LOCAL)),
        ({"E2E_CLUSTER": " Local "}, ClusterSelection(CLUSTER_LOCAL)),
        ({"E2E_CLUSTER": ""}, ClusterSelection(CLUSTER_LOCAL)),
        # WEIGHTSYNC_KUBECONFIG alone keeps working: an existing cluster.
        ({"WEIGHTSYNC_KUBECONFIG": "/k"}, ClusterSelection(CLUSTER_EXISTING, "/k")),
        ({"KUBECONFIG_E2E": "/k2"}, ClusterSelection(CLUSTER_EXISTING, "/k2")),
        ({"WEIGHTSYNC_KUBECONFIG": "/k", "KUBECONFIG_E2E": "/k2"}, ClusterSelection(CLUSTER_EXISTING, "/k")),
        ({"E2E_CLUSTER": "existing", "WEIGHTSYNC_KUBECONFIG": "/k"}, ClusterSelection(CLUSTER_EXISTING, "/k")),
        ({"E2E_CLUSTER": "kind"}, ClusterSelection(CLUSTER_KIND, None, "weightsync")),
        ({"E2E_CLUSTER": "KIND", "KIND_CLUSTER_NAME": "gpus"}, ClusterSelection(CLUSTER_KIND, None, "gpus")),
        ({"E2E_CLUSTER": "kind", "KIND_CLUSTER_NAME": " "}, ClusterSelection(CLUSTER_KIND, None, "weightsync")),
        # kind with an explicit kubeconfig: that file, no `kind get kubeconfig`.
        ({"E2E_CLUSTER": "kind", "WEIGHTSYNC_KUBECONFIG": "/k"}, ClusterSelection(CLUSTER_KIND, "/k", "weightsync")),
    ],
)
def test_select_cluster(env: dict[str, str], expected: ClusterSelection) -> None:
    assert select_cluster(env) == expected
    assert select_cluster(env).is_local == (expected.kind == CLUSTER_LOCAL)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"E2E_CLUSTER": "existing"}, "E2E_CLUSTER=existing needs WEIGHTSYNC_KUBECONFIG"),
        ({"E2E_CLUSTER": "local", "WEIGHTSYNC_KUBECONFIG": "/k"}, "unset one of them"),
        ({"E2E_CLUSTER": "minikube"}, "expected one of local, kind, existing"),
    ],
)
def test_select_cluster_refuses_contradictions(env: dict[str, str], message: str) -> None:
    with pytest.raises(ClusterSelectionError, match=message):
        select_cluster(env)
    assert not kind_selected(env)


def test_kind_selected() -> None:
    assert kind_selected({"E2E_CLUSTER": "kind"})
    assert not kind_selected({})
    assert not kind_selected({"WEIGHTSYNC_KUBECONFIG": "/k"})


def test_kind_kubeconfig_runs_kind_get_kubeconfig(tmp_path: Path) -> None:
    """`kind get kubeconfig --name NAME` is run and its output written, private (0600). /bin/echo stands in
    for kind (no kind here): what it prints is exactly the command line kind was given."""
    dest = kind_kubeconfig("gpus", tmp_path / "sub" / "kubeconfig", {"KIND": "/bin/echo"})
    assert dest.read_text() == "get kubeconfig --name gpus\n"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600


def test_kind_kubeconfig_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"failed \(exit 1\).*create-cluster.sh"):
        kind_kubeconfig("weightsync", tmp_path / "k", {"KIND": "/bin/false"})
    with pytest.raises(ClusterError, match="failed"):
        kind_kubeconfig("weightsync", tmp_path / "k", {"KIND": str(tmp_path / "no-such-kind")})
    assert not (tmp_path / "k").exists()


def test_kind_kubeconfig_without_kind_on_path(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="`kind` binary is not on PATH"):
        kind_kubeconfig("weightsync", tmp_path / "k", {"PATH": str(tmp_path)})


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kind-weightsync",
        "clusters": [{"name": "kind-weightsync", "cluster": {"server": server}}],
        "contexts": [{"name": "kind-weightsync", "context": {"cluster": "kind-weightsync", "user": "admin"}}],
        "users": [{"name": "admin", "user": {"token": "t"}}],
    }))
    return path


@pytest.mark.parametrize(("e2e_cluster", "kind"), [(None, CLUSTER_EXISTING), ("existing", CLUSTER_EXISTING),
                                                   ("kind", CLUSTER_KIND)])
def test_start_environment_attaches_to_the_selected_kubeconfig(tmp_path: Path, e2e_cluster: str | None,
                                                               kind: str) -> None:
    """With a kubeconfig (kind or existing) nothing is started: no control plane, no simulated nodes."""
    kc = _kubeconfig(tmp_path / "kc", "https://127.0.0.1:1")
    env = {"WEIGHTSYNC_KUBECONFIG": str(kc)}
    if e2e_cluster:
        env["E2E_CLUSTER"] = e2e_cluster
    environment = start_environment(env=env)
    try:
        assert environment.cluster_kind == kind
        assert environment.local is None and not environment.is_local
        assert environment.server == "https://127.0.0.1:1"
        assert environment.kubeconfig == kc.resolve()
        assert environment.nodes is None
    finally:
        environment.stop()


def test_start_environment_on_kind_without_a_cluster_fails_clearly() -> None:
    with pytest.raises(ClusterError, match=r"get kubeconfig --name nope.*create-cluster\.sh"):
        start_environment(env={"E2E_CLUSTER": "kind", "KIND_CLUSTER_NAME": "nope", "KIND": "/bin/false"})
    with pytest.raises(ClusterSelectionError):
        start_environment(env={"E2E_CLUSTER": "existing"})


def test_kind_tests_are_skipped_with_the_reason_unless_on_kind() -> None:
    """The `kind` tests of e2e/tests/ are collected but skipped (never passed) without E2E_CLUSTER=kind."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("E2E_CLUSTER", "WEIGHTSYNC_KUBECONFIG", "KUBECONFIG_E2E")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "kind",
         "e2e/tests/test_kind_gpu.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" not in proc.stdout
    assert "skipped" in proc.stdout and KIND_SKIP_REASON[:40] in proc.stdout, proc.stdout
