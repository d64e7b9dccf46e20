"""Per-job Prometheus series follow the aggregated status and vanish with the job."""

from __future__ import annotations

import json
from typing import Any, cast

from fakekube import FakeKube
from prometheus_client import REGISTRY
from test_status import T0, pod

from weightsync.crds import contract
from weightsync.operator import metrics
from weightsync.operator.kube import Kube
from weightsync.operator.placement import plan
from weightsync.operator.reconcile import Reconciler
from weightsync.operator.status import aggregate, ordered

LABELS = {"wsj_namespace": "ns-m", "wsj": "demo"}


def sample(name: str, **extra: str) -> float | None:
    return REGISTRY.get_sample_value(name, {**LABELS, **extra})


def _status(separated: Any) -> dict[str, Any]:
    spec = separated()
    last = json.dumps({"version": 7, "durationSeconds": 2.5, "bytes": 12345, "mode": "NCCL"})
    pods = {
        "demo-trainer-0": pod("demo-trainer-0", published=9),
        "demo-trainer-1": pod("demo-trainer-1", published=9),
        "demo-inference-0-0": pod("demo-inference-0-0", synced=True, served=9),
        "demo-inference-1-0": pod("demo-inference-1-0", synced=False, served=7, **{contract.ANN_LAST_SYNC: last}),
    }
    return ordered(aggregate(spec, 1, plan("demo", spec), pods, None, 1, now=T0))


def test_aggregated_status_is_exported(separated, cfg):
    metrics.record_job_status("ns-m", "demo", _status(separated))
    assert sample("weightsync_job_trainer_version") == 9
    assert sample("weightsync_job_served_version") == 7
    assert sample("weightsync_job_version_lag") == 2
    assert sample("weightsync_job_last_sync_duration_seconds") == 2.5
    assert sample("weightsync_job_last_sync_bytes") == 12345
    assert sample("weightsync_job_replicas", state="total") == 2
    assert sample("weightsync_job_replicas", state="ready") == 2
    assert sample("weightsync_job_replicas", state="synced") == 1
    assert sample("weightsync_job_trainer_epoch") == 0
    degraded = next(c for c in _status(separated)["conditions"] if c["type"] == "Degraded")
    assert sample("weightsync_job_degraded", reason=degraded["reason"]) == (1 if degraded["status"] == "True" else 0)

    # The job is gone: a reconcile by key finds nothing and drops every series of that job.
    Reconciler(cast(Kube, FakeKube()), cfg, events=cast(Any, object())).reconcile("ns-m", "demo")
    for name in ("weightsync_job_trainer_version", "weightsync_job_served_version", "weightsync_job_version_lag",
                 "weightsync_job_last_sync_duration_seconds", "weightsync_job_last_sync_bytes"):
        assert sample(name) is None
    assert sample("weightsync_job_replicas", state="total") is None


def test_unknown_versions_are_absent_not_zero():
    metrics.record_job_status("ns-m", "demo", {"trainerVersion": 3, "replicas": {"inference": 1}})
    assert sample("weightsync_job_trainer_version") == 3
    assert sample("weightsync_job_served_version") is None and sample("weightsync_job_version_lag") is None
    metrics.forget_job("ns-m", "demo")
    metrics.forget_job("ns-m", "demo")  # idempotent
    assert sample("weightsync_job_trainer_version") is None


def test_degraded_reason_is_one_series_per_job():
    def with_degraded(status: str, reason: str) -> dict[str, Any]:
        return {"trainerVersion": 3, "conditions": [{"type": "Degraded", "status": status, "reason": reason}]}

    metrics.record_job_status("ns-m", "demo", with_degraded("True", "EngineUnreachable"))
    assert sample("weightsync_job_degraded", reason="EngineUnreachable") == 1
    metrics.record_job_status("ns-m", "demo", with_degraded("True", "SyncFailed"))
    assert sample("weightsync_job_degraded", reason="EngineUnreachable") is None
    assert sample("weightsync_job_degraded", reason="SyncFailed") == 1
    metrics.record_job_status("ns-m", "demo", with_degraded("False", "AsExpected"))
    assert sample("weightsync_job_degraded", reason="SyncFailed") is None
    assert sample("weightsync_job_degraded", reason="AsExpected") == 0
    metrics.forget_job("ns-m", "demo")
    assert sample("weightsync_job_degraded", reason="AsExpected") is None
