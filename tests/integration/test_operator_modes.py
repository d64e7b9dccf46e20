"""Operator process modes: active/standby replicas through kopf peering, and cluster-wide scope."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_helpers import create_job, live_pods, separated_spec
from weightsync.e2e.binaries import find_binary
from weightsync.e2e.demo import wait_established
from weightsync.e2e.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[2] / "helm" / "weightsync-operator"


@pytest.fixture(scope="module")
def peering_crds(cluster: Any) -> None:
    """kopf's peering CRDs, as the chart installs them for replicaCount > 1."""
    rendered = subprocess.run(
        [str(find_binary("helm")), "template", "ws", str(CHART), "--kube-version", "1.34.4", "--set", "replicaCount=2",
         "--show-only", "templates/peering-crds.yaml"],
        capture_output=True, text=True, check=True,
    ).stdout
    cluster.kubectl("apply", "--server-side", "-f", "-", input=rendered)
    for doc in yaml.safe_load_all(rendered):
        if doc:
            wait_established(cluster.kubectl, doc["metadata"]["name"])
    # A new CRD's storage answers 429 for a moment; kopf's first keep-alive must not land in that window.
    wait_until(lambda: cluster.kubectl("get", "kopfpeerings", "-A", check=False).returncode == 0,
               timeout=60, what="kopfpeerings served")


def _peer_priorities(kube: Any, namespace: str) -> list[int]:
    try:
        obj = kube.custom.get_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings", "ws-peer")
    except Exception:
        return []
    return [int(v.get("priority", 0)) for v in (obj.get("status") or {}).values() if isinstance(v, dict)]


def _streams_paused(log: str) -> bool:
    """kopf starts a mandatory-peering operator paused (and logs only transitions), so look at the
    last state change of the job watch-stream."""
    lines = [ln for ln in log.splitlines() if "watch-stream for weightsyncjobs" in ln]
    return bool(lines) and lines[-1].startswith("Pausing")


def test_peering_keeps_one_active_replica_and_fails_over(kube, namespace, operator, peering_crds):
    active = operator("--peering", "ws-peer", "--priority", "100")
    wait_until(lambda: 100 in _peer_priorities(kube, namespace), timeout=60, what="active announced in peering")
    standby = operator("--peering", "ws-peer", "--priority", "50")
    # kopf peering is not a lease: a replica acts until it has seen a higher-priority peer. Create the job
    # only once the standby has paused its streams (reconciles are idempotent, so an overlap is harmless).
    wait_until(lambda: sorted(_peer_priorities(kube, namespace)) == [50, 100], timeout=60, what="standby announced")
    time.sleep(2)  # the standby has seen the peering object (its own keep-alive went through it)
    assert _streams_paused(standby.log()), standby.log()[-3000:]
    create_job(kube, namespace, "ha", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    wait_until(lambda: len(live_pods(kube, namespace, "ha")) == 2, what="pods from the active replica")
    time.sleep(3)  # > one resync period: the standby's resync must stay quiet too
    assert "created kind=Pod" in active.log()
    assert "created kind=" not in standby.log() and "patched kind=" not in standby.log()

    assert active.stop() == 0
    wait_until(lambda: "Resuming operations" in standby.log(), timeout=60, what="standby resumes")
    old = live_pods(kube, namespace, "ha")["ha-trainer-0"]["metadata"]["uid"]
    kube.core.delete_namespaced_pod("ha-trainer-0", namespace, grace_period_seconds=0)
    wait_until(lambda: (p := live_pods(kube, namespace, "ha").get("ha-trainer-0")) and p["metadata"]["uid"] != old,
               timeout=60, what="the former standby recreates the pod")
    assert "created kind=Pod name=" in standby.log()


def test_cluster_wide_mode_serves_any_namespace(kube, namespace, operator):
    op = operator(cluster_wide=True)
    create_job(kube, namespace, "wide", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    wait_until(lambda: len(live_pods(kube, namespace, "wide")) == 2, timeout=60, what="pods in the test namespace")
    assert op.alive()
