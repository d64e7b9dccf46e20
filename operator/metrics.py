"""Prometheus metrics of the operator process (served on --metrics-port, scraped via the chart's Service)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

RECONCILES = Counter(
    "weightsync_operator_reconciles_total",
    "Reconcile passes, by result (changed: something was created, patched, deleted or the status written).",
    ["result"],
)
RECONCILE_ERRORS = Counter(
    "weightsync_operator_reconcile_errors_total",
    "Reconcile passes that raised (API errors, bugs); the pass is retried with backoff.",
)
RECONCILE_DURATION = Histogram(
    "weightsync_operator_reconcile_duration_seconds",
    "Wall time of one reconcile pass.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RECONCILE_WAIT = Histogram(
    "weightsync_operator_reconcile_wait_seconds",
    "From the first request for a job's pass (a watch event, a pushed report, the resync) until the pass runs: "
    "the batch window plus the wait for a worker thread and the event loop.",
    buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0),
)
STATUS_WRITE_DURATION = Histogram(
    "weightsync_operator_status_write_seconds",
    "Round trip of one job status write (the PATCH of the status subresource).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
GC_PAUSE = Histogram(
    "weightsync_operator_gc_pause_seconds",
    "Full (generation 2) garbage collections of the operator process: every thread, the event loop included, "
    "stops meanwhile, so a long one delays every pass.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
JOBS = Gauge("weightsync_operator_jobs", "WeightSyncJobs this operator instance currently tracks.")
API_REQUESTS = Counter(
    "weightsync_operator_api_requests_total",
    "Requests this operator sent to the API server, by verb (get, list, watch, create, patch, delete) and kind.",
    ["verb", "kind"],
)
CACHED_OBJECTS = Gauge("weightsync_operator_cached_objects", "Objects held in the operator's watch caches, by kind.",
                       ["kind"])
RELISTS = Counter("weightsync_operator_informer_relists_total",
                  "Full LISTs by the watch caches, by kind (1 per kind and namespace at start; more after 410 Gone "
                  "or a broken watch).", ["kind"])
REPORTS = Counter(
    "weightsync_operator_reports_total",
    "Reports pushed by agents to this replica, by result (taken; standby, unchecked, unknown_pod, bad_signature, "
    "stale, bad_request, too_large, timeout, busy: refused, the agent writes its pod instead).",
    ["result"],
)
REPORTS_HELD = Gauge("weightsync_operator_reports_held",
                     "Pushed reports laid over pods whose own annotations have not caught up yet.")
LEADER = Gauge("weightsync_operator_leader", "1 while this replica is the active one (always 1 without peering).")

# --- per-job series, set from each aggregated status (what `kubectl get wsj` shows, as time series) ------
# Not `namespace` / `job`: Prometheus sets those on every scraped series (the scrape target's), and would
# rename ours to exported_namespace / exported_job.
JOB_LABELS = ("wsj_namespace", "wsj")
JOB_TRAINER_VERSION = Gauge("weightsync_job_trainer_version", "Newest weight version every trainer pod published.",
                            JOB_LABELS)
JOB_SERVED_VERSION = Gauge("weightsync_job_served_version", "Oldest version served by a Ready inference replica.",
                           JOB_LABELS)
JOB_VERSION_LAG = Gauge("weightsync_job_version_lag", "trainer_version - served_version (versions behind).",
                        JOB_LABELS)
JOB_LAST_SYNC_DURATION = Gauge("weightsync_job_last_sync_duration_seconds", "Wall time of the newest completed sync.",
                               JOB_LABELS)
JOB_LAST_SYNC_BYTES = Gauge("weightsync_job_last_sync_bytes", "Bytes moved by the newest completed sync.", JOB_LABELS)
JOB_REPLICAS = Gauge("weightsync_job_replicas",
                     "Inference replicas by state (total: exist, ready: Ready, synced: serve the newest version).",
                     (*JOB_LABELS, "state"))
REPLICA_STATES = ("synced", "ready", "total")
JOB_TRAINER_EPOCH = Gauge("weightsync_job_trainer_epoch", "Trainer epoch of the trainer version (bumped when a "
                          "restarted trainer publishes again from a version it already published).", JOB_LABELS)
JOB_DEGRADED = Gauge("weightsync_job_degraded", "1 while the job's Degraded condition is True, labelled with its "
                     "reason (one series per job: the current reason).", (*JOB_LABELS, "reason"))
_JOB_GAUGES = (JOB_TRAINER_VERSION, JOB_SERVED_VERSION, JOB_VERSION_LAG, JOB_LAST_SYNC_DURATION, JOB_LAST_SYNC_BYTES,
               JOB_TRAINER_EPOCH)
_degraded_reason: dict[tuple[str, str], str] = {}


def _set_or_remove(gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
    """An unknown value is an absent series, not a misleading 0."""
    if value is None:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)
    else:
        gauge.labels(*labels).set(value)


def record_job_status(namespace: str, job: str, status: Mapping[str, Any]) -> None:
    """Export one job's aggregated status (the dict written to the API, camelCase keys)."""
    key = (namespace, job)
    tv, sv = status.get("trainerVersion"), status.get("servedVersion")
    _set_or_remove(JOB_TRAINER_VERSION, key, tv)
    _set_or_remove(JOB_SERVED_VERSION, key, sv)
    _set_or_remove(JOB_VERSION_LAG, key, tv - sv if tv is not None and sv is not None else None)
    last = status.get("lastSync") or {}
    _set_or_remove(JOB_LAST_SYNC_DURATION, key, last.get("durationSeconds"))
    _set_or_remove(JOB_LAST_SYNC_BYTES, key, last.get("bytes"))
    counts = status.get("replicas") or {}
    for state, field in zip(REPLICA_STATES, ("synced", "ready", "inference"), strict=True):
        JOB_REPLICAS.labels(namespace, job, state).set(counts.get(field, 0))
    _set_or_remove(JOB_TRAINER_EPOCH, key, status.get("trainerEpoch") if tv is not None else None)
    degraded = next((c for c in status.get("conditions") or [] if c.get("type") == "Degraded"), None)
    reason = str(degraded.get("reason") or "Unknown") if degraded and degraded.get("status") == "True" else "AsExpected"
    old = _degraded_reason.get(key)
    if old is not None and old != reason:
        _set_or_remove(JOB_DEGRADED, (*key, old), None)
    _degraded_reason[key] = reason
    JOB_DEGRADED.labels(namespace, job, reason).set(0 if reason == "AsExpected" else 1)


def forget_job(namespace: str, job: str) -> None:
    """Drop a deleted job's series so dashboards do not show a ghost."""
    for gauge in _JOB_GAUGES:
        _set_or_remove(gauge, (namespace, job), None)
    for state in REPLICA_STATES:
        _set_or_remove(JOB_REPLICAS, (namespace, job, state), None)
    reason = _degraded_reason.pop((namespace, job), None)
    if reason is not None:
        _set_or_remove(JOB_DEGRADED, (namespace, job, reason), None)


_started_port: int | None = None


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics HTTP server once per process; port 0 disables it."""
    global _started_port
    if port <= 0 or _started_port is not None:
        return
    start_http_server(port, addr=addr)
    _started_port = port
    log.info("metrics server listening port=%d", port)
