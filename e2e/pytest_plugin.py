"""pytest fixtures for tests that need Kubernetes. Load with `pytest_plugins = ["weightsync.e2e.pytest_plugin"]`
in a conftest.py at the top of a test tree (tests/conftest.py does).

Fixtures:
  cluster          (session) an `Environment`: one local control plane + 4 simulated GPU nodes per test
                   session, started lazily by the first test that needs it; or the cluster named by
                   WEIGHTSYNC_KUBECONFIG / KUBECONFIG_E2E (kind, nvkind: the same suite, another cluster).
  process_runtime  (session) the process runtime running the pods of process nodes (None where it is
                   not available or not wanted, e.g. on kind).
  kube             (session) typed API clients: kube.core, kube.apps, kube.rbac, kube.coordination,
                   kube.custom, kube.batch (one admin ApiClient).
  namespace        (function) a fresh namespace for the test, deleted after it.

Tests using any of them get the `cluster` marker automatically (so `-m 'not cluster'` skips them and
never starts a control plane). Tests marked `kind` (a kind GPU cluster only, e.g. e2e/tests/test_kind_gpu.py)
are skipped, with the reason, unless E2E_CLUSTER=kind (see weightsync.e2e.environment.select_cluster).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from weightsync.e2e.binaries import BinaryNotFound
from weightsync.e2e.cluster import ClusterError
from weightsync.e2e.environment import (
    CLUSTER_KIND,
    ClusterSelectionError,
    Environment,
    runtime_wanted,
    select_cluster,
    start_environment,
)

log = logging.getLogger("weightsync.e2e.pytest")

CLUSTER_FIXTURES = frozenset({"cluster", "process_runtime", "kube", "namespace"})
LABEL_TEST_NAMESPACE = "weightsync.io/test-namespace"
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.2,
               what: str = "condition") -> T:
    """Poll PREDICATE until it returns something truthy (returned); fail the test after TIMEOUT seconds.
    API errors while polling are retried (the last one is shown on timeout)."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ApiException as exc:
            last_error = exc
        if time.monotonic() > deadline:
            suffix = f" (last API error: {last_error})" if last_error else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}{suffix}")
        time.sleep(interval)


@dataclass(frozen=True)
class Kube:
    """Typed API groups over one admin ApiClient."""

    api: kubernetes.client.ApiClient
    core: kubernetes.client.CoreV1Api
    apps: kubernetes.client.AppsV1Api
    rbac: kubernetes.client.RbacAuthorizationV1Api
    coordination: kubernetes.client.CoordinationV1Api
    custom: kubernetes.client.CustomObjectsApi
    batch: kubernetes.client.BatchV1Api

    @classmethod
    def of(cls, api: kubernetes.client.ApiClient) -> Kube:
        c = kubernetes.client
        return cls(api, c.CoreV1Api(api), c.AppsV1Api(api), c.RbacAuthorizationV1Api(api),
                   c.CoordinationV1Api(api), c.CustomObjectsApi(api), c.BatchV1Api(api))


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so the plugin works outside this repository's pytest configuration.
    config.addinivalue_line("markers", "cluster: needs a Kubernetes control plane (local or WEIGHTSYNC_KUBECONFIG)")
    config.addinivalue_line("markers", "slow: long-running")
    config.addinivalue_line("markers", "kind: needs a kind cluster with GPU nodes (E2E_CLUSTER=kind, e2e/kind/)")


KIND_SKIP_REASON = ("needs a kind cluster with GPU nodes: run with E2E_CLUSTER=kind after e2e/kind/create-cluster.sh "
                    "(e2e/kind/run-e2e.sh; see e2e/kind/README.md)")


def kind_selected(env: Mapping[str, str] | None = None) -> bool:
    """Whether E2E_CLUSTER=kind (a contradictory setting is not kind; the cluster fixture reports it)."""
    try:
        return select_cluster(os.environ if env is None else env).kind == CLUSTER_KIND
    except ClusterSelectionError:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a cluster fixture `cluster` (before `-m` deselects); skip `kind` tests
    unless E2E_CLUSTER=kind."""
    on_kind = kind_selected()
    for item in items:
        if item.get_closest_marker("kind") is not None and not on_kind:
            item.add_marker(pytest.mark.skip(reason=KIND_SKIP_REASON))
        names = set(getattr(item, "fixturenames", ()))
        if names & CLUSTER_FIXTURES and item.get_closest_marker("cluster") is None:
            item.add_marker(pytest.mark.cluster)


_SUMMARY = pytest.StashKey[list[str]]()


_START_ERROR = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[Environment]:
    # pytest retries a failed session fixture for every test that needs it: fail fast after the first.
    if _START_ERROR in request.config.stash:
        pytest.fail(request.config.stash[_START_ERROR], pytrace=False)
    try:
        environment = start_environment()
    except (BinaryNotFound, ClusterError) as exc:
        request.config.stash[_START_ERROR] = f"cannot start the test cluster: {exc}"
        pytest.fail(request.config.stash[_START_ERROR], pytrace=False)
    summary = request.config.stash.setdefault(_SUMMARY, [])
    local = environment.local
    if local is not None:
        log.info("test cluster ready start_seconds=%.2f server=%s logs=%s", local.start_seconds or -1,
                 environment.server, local.log_dir)
        summary.append(f"local control plane: ready in {local.start_seconds or 0:.1f} s "
                       f"(phases {', '.join(f'{k}={v:.1f}' for k, v in local.phase_seconds.items())})")
    else:
        summary.append(f"{environment.cluster_kind} cluster: {environment.server}")
    try:
        yield environment
    finally:
        if local is not None and request.session.testsfailed:
            local.keep_work_dir = True  # failures: keep the component logs for the post-mortem
            summary.append(f"tests failed: control-plane logs kept in {local.log_dir}")
        environment.stop()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    for line in config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def process_runtime(cluster: Environment) -> Any | None:
    if not runtime_wanted(cluster):
        return None
    return cluster.start_runtime()


@pytest.fixture(scope="session")
def kube(cluster: Environment) -> Iterator[Kube]:
    api = cluster.api_client()
    try:
        yield Kube.of(api)
    finally:
        api.close()


def namespace_name(test_name: str) -> str:
    """A valid, unique namespace name derived from the test's name (DNS-1123 label, ≤ 63 chars)."""
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:48].strip("-") or "test"
    return f"t-{base}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(cluster: Environment, kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists (pods can be created at once). Afterwards it
    is deleted; locally, with no process runtime to confirm pod deletions, its bound pods are removed at
    once (grace 0) so the namespace does not hang in Terminating."""
    name = namespace_name(request.node.name)
    body: Any = {"metadata": {"name": name, "labels": {LABEL_TEST_NAMESPACE: "true"}}}
    kube.core.create_namespace(body)
    wait_until(lambda: kube.core.read_namespaced_service_account("default", name), timeout=60,
               what=f"serviceaccount {name}/default")
    try:
        yield name
    finally:
        try:
            if cluster.is_local and cluster.runtime is None:
                kube.core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
            kube.core.delete_namespace(name, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise
