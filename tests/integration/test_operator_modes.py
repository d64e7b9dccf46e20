"""Operator process modes: active/standby replicas through kopf peering (leader election), and cluster-wide scope."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_helpers import create_job, get_job, live_pods, separated_spec

from weightsync.e2e.binaries import find_binary
from weightsync.e2e.demo import wait_established
from weightsync.e2e.procs import free_port
from weightsync.e2e.pytest_plugin import wait_until
from weightsync.operator.leadership import PEERING_LIFETIME_S, REFRESH_SECONDS

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


def _writes(port: int) -> dict[str, float]:
    """The operator's own write requests by kind (weightsync_operator_api_requests_total), peering excluded."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("weightsync_operator_api_requests_total{"):
            continue
        labels, value = line.rsplit(" ", 1)
        verb = labels.split('verb="', 1)[1].split('"', 1)[0]
        kind = labels.split('kind="', 1)[1].split('"', 1)[0]
        if verb in ("create", "patch", "delete") and "Peering" not in kind:
            out[f"{verb} {kind}"] = out.get(f"{verb} {kind}", 0.0) + float(value)
    return {k: v for k, v in out.items() if v > 0}


def test_peering_keeps_one_active_replica_and_a_killed_leader_is_replaced(kube, namespace, operator, peering_crds):
    """Two real operator processes on one peering object: only the higher priority writes anything (its
    own request counters say so), and when it is SIGKILLed (no chance to leave the peering object) the
    standby takes over within the entry's lifetime plus one refresh, and repairs the job."""
    active_port, standby_port = free_port(), free_port()
    active = operator("--peering", "ws-peer", "--priority", "100", metrics_port=active_port)
    wait_until(lambda: 100 in _peer_priorities(kube, namespace), timeout=60, what="active announced in peering")
    standby = operator("--peering", "ws-peer", "--priority", "50", metrics_port=standby_port)
    wait_until(lambda: sorted(_peer_priorities(kube, namespace)) == [50, 100], timeout=60, what="standby announced")
    wait_until(lambda: "leadership active=False" in standby.log(), timeout=30, what="standby decided it is passive")
    assert "leadership active=True" in active.log()
    create_job(kube, namespace, "ha", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    wait_until(lambda: len(live_pods(kube, namespace, "ha")) == 2, what="pods from the active replica")
    wait_until(lambda: get_job(kube, namespace, "ha").get("status", {}).get("conditions"), what="status written")
    time.sleep(3)  # > one resync period (2 s): the standby's resync must stay quiet too
    assert "create Pod" in _writes(active_port) and "patch WeightSyncJob" in _writes(active_port)
    assert _writes(standby_port) == {}, standby.log()[-3000:]
    assert "created kind=" not in standby.log() and "patched kind=" not in standby.log()

    active.proc.kill()  # SIGKILL: its peering entry stays until it expires
    active.proc.wait(timeout=10)
    killed = time.monotonic()
    old = live_pods(kube, namespace, "ha")["ha-trainer-0"]["metadata"]["uid"]
    kube.core.delete_namespaced_pod("ha-trainer-0", namespace, grace_period_seconds=0)
    wait_until(lambda: (p := live_pods(kube, namespace, "ha").get("ha-trainer-0")) and p["metadata"]["uid"] != old,
               timeout=90, what="the former standby recreates the pod")
    took = time.monotonic() - killed
    bound = PEERING_LIFETIME_S + REFRESH_SECONDS + 10  # + pass, batch window and a loaded machine
    assert took <= bound, f"takeover took {took:.1f} s (bound {bound:.0f} s)"
    assert "leadership active=True" in standby.log()
    assert "create Pod" in _writes(standby_port)
    print(f"takeover after SIGKILL: {took:.1f} s (bound {bound:.0f} s)")


def test_cluster_wide_mode_serves_any_namespace(kube, namespace, operator):
    op = operator(cluster_wide=True)
    create_job(kube, namespace, "wide", separated_spec(trainer_pods=1, trainer_gpus=1, replicas=1, gpus_per_replica=1))
    wait_until(lambda: len(live_pods(kube, namespace, "wide")) == 2, timeout=60, what="pods in the test namespace")
    assert op.alive()
