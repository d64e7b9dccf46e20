"""Fixtures of the closed-loop e2e suite (issue 6): the cluster fixtures of weightsync.e2e.pytest_plugin
plus the CRD, the real operator as a process per test namespace, and demo jobs built from examples/.

Locally the session starts one control plane + 4 simulated process nodes + the process runtime; with
WEIGHTSYNC_KUBECONFIG (kind, nvkind) the same tests run against that cluster (real kubelets run the
example images; the tests that kill host processes need the process runtime and are skipped there).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from weightsync.e2e import demo
from weightsync.e2e.environment import Environment, runtime_wanted

pytest_plugins = ["weightsync.e2e.pytest_plugin"]


@pytest.fixture(scope="session")
def process_runtime(cluster: Environment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any | None]:
    """The plugin's fixture, but on a private pod CIDR (parallel sessions on one machine would otherwise
    hand out the same pod IPs, and agents would fight over ports)."""
    if runtime_wanted(cluster):
        yield demo.start_private_runtime(cluster, tmp_path_factory.mktemp("runtime"))
        return
    # No process runtime (kind): pod IPs are not reachable from here, so pod HTTP goes through the API server.
    api = cluster.api_client()
    demo.POD_PROXY = api
    try:
        yield None
    finally:
        demo.POD_PROXY = None
        api.close()


@pytest.fixture(scope="session")
def wsj_crd(cluster: Environment) -> str:
    demo.install_crd(cluster)
    return demo.contract.CRD_NAME


@pytest.fixture
def operator(cluster: Environment, namespace: str, wsj_crd: str, process_runtime: Any, tmp_path: Path,
             request: pytest.FixtureRequest) -> Iterator[Callable[[], demo.OperatorProcess]]:
    """Start (or, after a kill, restart) the real operator for the test's namespace; on failure its logs
    and the tails of every container log are printed."""
    started: list[demo.OperatorProcess] = []

    def start() -> demo.OperatorProcess:
        # The process runtime's agents reach the operator's report listener on the host; kind's cannot.
        op = demo.start_operator(cluster.kubeconfig, namespace, tmp_path / "operator", resync_seconds=5.0,
                                 report_address="127.0.0.1" if process_runtime is not None else None)
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for op in started:
            print(f"--- operator log {op.log_path} ---\n{op.log()[-5000:]}")
        with cluster.api_client() as api:
            pods: dict[str, Any] = {}
            for job in _jobs(api, namespace):
                pods.update(demo.job_pods(api, namespace, job))
            print(demo.log_tails(cluster, namespace, pods, lines=25))


def _jobs(api: Any, namespace: str) -> list[str]:
    import kubernetes

    custom = kubernetes.client.CustomObjectsApi(api)
    listed: Any = custom.list_namespaced_custom_object(demo.contract.GROUP, demo.contract.VERSION, namespace,
                                                       demo.contract.PLURAL)
    return [j["metadata"]["name"] for j in listed["items"]]


@pytest.fixture
def demo_job(cluster: Environment, namespace: str, process_runtime: Any) -> Callable[..., dict[str, Any]]:
    """Apply a demo example in the test namespace: demo_job("separated", versions=8, interval=1.0,
    hidden=256, replicas=2) -> the applied manifest (a unique job name per call)."""

    def make(example: str, *, versions: int | None = None, interval: float | None = None,
             hidden: int | None = None, replicas: int | None = None, bucket_mb: int | None = None,
             name: str | None = None) -> dict[str, Any]:
        body = demo.load_example(example, process_nodes=process_runtime is not None,
                                 name_override=name or f"{example[:3]}-{secrets.token_hex(2)}")
        flags: dict[str, Any] = {}
        if versions is not None:
            flags["versions"] = versions
        if interval is not None:
            flags["interval"] = interval
        demo.set_trainer_args(body, **flags)
        if hidden is not None:
            demo.set_demo_env(body, WEIGHTSYNC_DEMO_HIDDEN=str(hidden))
        if replicas is not None:
            body["spec"]["inference"]["replicas"] = replicas
        if bucket_mb is not None:
            body["spec"]["transfer"]["bucketSizeMB"] = bucket_mb
        demo.apply(cluster, body, namespace)
        return body

    return make


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)
