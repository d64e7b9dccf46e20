"""Fixtures for agent process tests: clusters of pod-processes that are always stopped, logs on failure."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from podprocs import Cluster


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def clusters(request: pytest.FixtureRequest) -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    yield made
    rep = getattr(request.node, "rep_call", None)
    for c in made:
        c.stop_all()
        if rep is not None and rep.failed:
            print(c.dump_logs())
