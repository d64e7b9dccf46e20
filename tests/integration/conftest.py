"""Fixtures for the operator integration tests: the generated CRD applied to the session's real control
plane and the real operator process, namespace-scoped, started per test."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from op_helpers import CRD_FILE, POOL, POOL_LABEL, OperatorProcess, force_delete_pods, start_operator

from weightsync.crds import contract
from weightsync.e2e.nodes import NodeSimulator, gpu_fleet
from weightsync.e2e.pytest_plugin import wait_until


@pytest.fixture(scope="session")
def wsj_crd(cluster: Any) -> str:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=weightsync-tests",
                    "-f", str(CRD_FILE))

    def established() -> bool:
        r = cluster.kubectl("get", f"crd/{contract.CRD_NAME}", "-o",
                            "jsonpath={.status.conditions[?(@.type=='Established')].status}", check=False)
        return r.returncode == 0 and r.stdout.strip() == "True"

    # Polled rather than `kubectl wait`: right after start the API server may answer 429 while its
    # storage initialises.
    wait_until(established, timeout=90, what=f"CRD {contract.CRD_NAME} Established")
    return contract.CRD_NAME


@pytest.fixture(scope="session")
def op_nodes(cluster: Any) -> Iterator[list[str]]:
    """Four 8-GPU simulated nodes (2 racks) for these tests only: labelled and tainted as the pool."""
    specs = [
        dataclasses.replace(s, extra_labels={POOL_LABEL: POOL},
                            taints=[{"key": POOL_LABEL, "value": POOL, "effect": "NoSchedule"}])
        for s in gpu_fleet(4, prefix="op-gpu", process=False)
    ]
    sim = NodeSimulator(cluster.api_client, specs).start()
    try:
        yield sim.node_names
    finally:
        sim.stop(delete=True)


@pytest.fixture
def operator(cluster: Any, kube: Any, namespace: str, wsj_crd: str, op_nodes: list[str], tmp_path: Path,
             request: pytest.FixtureRequest) -> Iterator[Callable[..., OperatorProcess]]:
    """Start the operator for the test's namespace (call it again after stopping to restart). The pods
    are force-deleted at the end so the simulated GPUs are free for the next test."""
    started: list[OperatorProcess] = []

    def start(*extra: str, metrics_port: int = 0, cluster_wide: bool = False) -> OperatorProcess:
        op = start_operator(Path(cluster.kubeconfig), None if cluster_wide else namespace, tmp_path, *extra,
                            metrics_port=metrics_port)
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for op in started:
            print(f"--- operator log {op.log_path} ---\n{op.log()[-6000:]}")
    force_delete_pods(kube, namespace)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)
