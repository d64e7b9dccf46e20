"""The real-engine-server tier: each test's outcome is kept on its item, so a module's fixture prints the pods'
logs (the engine's included) when any of its tests failed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)
