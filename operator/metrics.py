"""Prometheus metrics of the operator process (served on --metrics-port, scraped via the chart's Service)."""

from __future__ import annotations

import logging

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
JOBS = Gauge("weightsync_operator_jobs", "WeightSyncJobs this operator instance currently tracks.")

_started_port: int | None = None


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics HTTP server once per process; port 0 disables it."""
    global _started_port
    if port <= 0 or _started_port is not None:
        return
    start_http_server(port, addr=addr)
    _started_port = port
    log.info("metrics server listening port=%d", port)
