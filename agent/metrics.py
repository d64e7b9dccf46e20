"""Prometheus metrics of one agent (bytes, seconds, versions), on its own registry so tests can run several
agents in one process and the operator's metrics never mix with the agent's."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weightsync.agent.staging.segments import STAGING

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class AgentMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.transfer_bytes = Counter(
            "weightsync_agent_transfer_bytes_total", "Weight bytes moved between agents",
            ["direction", "mode"], registry=r)
        self.verified_bytes = Counter(
            "weightsync_agent_verified_bytes_total", "Received bytes whose bucket checksum matched the sender's",
            registry=r)
        self.wire_bytes = Counter(
            "weightsync_agent_wire_bytes_total", "Bytes an inference agent actually read for committed versions: a "
            "bucket received as a delta counts its encoded size (equals transfer bytes without delta sync)",
            ["mode"], registry=r)
        self.received_buckets = Counter(
            "weightsync_agent_received_buckets_total", "Buckets an inference agent received for committed versions "
            "(what the per-bucket costs of a version scale with, where the per-tensor ones scale with tensors)",
            registry=r)
        self.delta_buckets = Counter(
            "weightsync_agent_delta_buckets_total", "Buckets an inference agent received as a delta "
            "(spec.transfer.deltaSync) instead of in full, for committed versions", registry=r)
        self.sync_progress_buckets = Gauge(
            "weightsync_agent_sync_progress_buckets", "Buckets of the version being loaded that arrived so far "
            "(0 between loads; inference)", registry=r)
        self.sync_progress_bytes = Gauge(
            "weightsync_agent_sync_progress_bytes", "Bytes of the version being loaded that arrived so far "
            "(0 between loads; inference)", registry=r)
        self.staged_bytes = Counter(
            "weightsync_agent_staged_bytes_total", "Bytes the local trainer published into staging", registry=r)
        self.copied_bytes = Counter(
            "weightsync_agent_copied_bytes_total", "Weight bytes copied in memory besides the wire and the engine's "
            "own load, by stage: publish (trainer into staging; ring staging: into each transfer's ring slots), "
            "snapshot (ring staging: the trainer's snapshot of its shards), pack (staging into a send buffer), unpack "
            "(receive buffer into assembled tensors), engine_pack (into the Custom engine's segment, or the bucket packed for vLLM's weightsync backend)",
            ["stage"], registry=r)
        self.digest_bytes = Counter(
            "weightsync_agent_digest_bytes_total", "Bytes the content digest covered, by side (sent, received) and "
            "whether their piece hashes were computed here (hashed) or sent as an earlier transfer of the same staged "
            "version computed them (reused: the trainer agent hashes a version once, whatever the replicas; a "
            "receiver, where the bucket landed in the very staging file its own agent hashed, as over IPC in a "
            "Colocated pod)",
            ["side", "source"], registry=r)
        self.staging_bytes = Gauge(
            "weightsync_agent_staging_bytes", "Staging memory this agent holds now: shared segments and "
            "transport slot buffers", registry=r)
        self.staging_bytes.set_function(lambda: STAGING.current)
        self.staging_peak_bytes = Gauge(
            "weightsync_agent_staging_peak_bytes", "Most staging memory this agent held at once since it started",
            registry=r)
        self.staging_peak_bytes.set_function(lambda: STAGING.peak)
        self.snapshot_bytes = Gauge(
            "weightsync_agent_trainer_snapshot_bytes", "Ring staging: memory the local trainer processes hold as "
            "snapshots of the versions this agent streams (device memory for CUDA tensors; 0 when held)", registry=r)
        self.ring_transfers = Gauge(
            "weightsync_agent_ring_transfers", "Ring staging: transfers streaming through a ring now (each holds "
            "depth x its largest bucket of staging; the ring goes back to the pool when the transfer ends)", registry=r)
        self.sync_seconds = Histogram(
            "weightsync_agent_sync_seconds", "Seconds to fetch, load and commit one version (inference)",
            ["mode"], buckets=_SECONDS, registry=r)
        self.engine_stall_seconds = Histogram(
            "weightsync_agent_engine_stall_seconds", "Seconds the engine's generation was paused for one load "
            "(updatePolicy.pauseGeneration: paused to resumed; inference)", buckets=_SECONDS, registry=r)
        self.serve_seconds = Histogram(
            "weightsync_agent_serve_seconds", "Seconds to serve one version to one inference agent (trainer)",
            ["mode"], buckets=_SECONDS, registry=r)
        self.publish_seconds = Histogram(
            "weightsync_agent_publish_seconds", "Seconds from a stage request to the published reply",
            buckets=_SECONDS, registry=r)
        self.versions = Counter(
            "weightsync_agent_versions_total", "Versions handled, by result", ["result"], registry=r)
        self.published_version = Gauge(
            "weightsync_agent_published_version", "Newest version staged by the local trainer", registry=r)
        self.served_version = Gauge(
            "weightsync_agent_served_version", "Version the local engine serves (committed)", registry=r)
        self.target_version = Gauge(
            "weightsync_agent_target_version", "Version this agent should serve", registry=r)
        self.prepared_version = Gauge(
            "weightsync_agent_prepared_version", "updatePolicy.strategy Atomic: version held prepared (0: none)",
            registry=r)
        self.prepared_bytes = Gauge(
            "weightsync_agent_prepared_bytes", "updatePolicy.strategy Atomic: host memory holding the prepared version",
            registry=r)
        self.engine_paused = Gauge(
            "weightsync_agent_engine_paused", "1 while the engine is paused by spec.paused", registry=r)
        self.rejected_frames = Counter(
            "weightsync_agent_rejected_frames_total", "Control-channel frames rejected, by reason",
            ["reason"], registry=r)
        self.rejected_connections = Gauge(
            "weightsync_agent_rejected_connections", "Control-channel connections that failed the token handshake",
            registry=r)
        self.api_writes = Counter(
            "weightsync_agent_api_writes_total", "Writes to the Kubernetes API, by kind", ["kind"], registry=r)
        self.reports_pushed = Counter(
            "weightsync_agent_reports_pushed_total", "Reports pushed to the operator, by result (taken; refused "
            "or failed: the pod is written at once instead)", ["result"], registry=r)
        self.report_push_seconds = Histogram(
            "weightsync_agent_report_push_seconds", "Seconds per report pushed to the operator",
            buckets=_SECONDS, registry=r)
        self.api_write_seconds = Histogram(
            "weightsync_agent_api_write_seconds", "Seconds per Kubernetes API write", ["kind"],
            buckets=_SECONDS, registry=r)
