"""Fixtures for the API tests: the WeightSyncJob CRD installed (server-side apply, as users do) in the
session cluster from tests/conftest.py; no operator runs, so everything observed is the API server's own
work (schema validation, CEL, defaulting, printer columns)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from api_helpers import CRD_FILE

from weightsync.crds import contract
from weightsync.e2e.demo import wait_established


@pytest.fixture(scope="session")
def crd(cluster: Any) -> str:
    """Install (or update) the generated CRD and wait until it is Established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=weightsync-tests",
                    "-f", str(CRD_FILE))
    wait_established(cluster.kubectl, contract.CRD_NAME)
    # The OpenAPI document (kubectl explain, client-side field checks) is published a moment after
    # Established: wait for it so each test can run alone.
    deadline = time.monotonic() + 60
    while cluster.kubectl("explain", f"{contract.SHORT_NAME}.spec.transfer", check=False).returncode != 0:
        assert time.monotonic() < deadline, "the WeightSyncJob OpenAPI schema was not published within 60s"
        time.sleep(0.5)
    return contract.CRD_NAME


@pytest.fixture(scope="module")
def api_ns(cluster: Any, crd: str) -> Iterator[str]:
    """One namespace for a whole module: the validation table has ~40 cases and none of them leaves an
    object behind that another case could see (every case uses its own name)."""
    name = f"wsj-api-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)

