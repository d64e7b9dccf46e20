"""GDR (NIXL over UCX) in the real agent processes: demo trainer, agents and demo engines on loopback IPs.

What is checked, bit for bit: every engine serves the sha256 checksums the trainer computed for the same
version; a replica added to the topology after the trainer published pulls the current version over
one-sided READs while the others keep serving (no re-fetch, no extra commit); `verify: Checksum` runs on
the GDR path; with delta sync (spec.transfer.deltaSync) only changed words move and the engines stay
bit-exact. On this CPU-only machine UCX moves DRAM over tcp/cma (the agent sets UCX_TLS itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from podprocs import (
    Cluster,
    Pod,
    agent_served,
    engine_version,
    get_json,
    get_text,
    kill_inference_agent_mid_load,
    metric_value,
    wait_for,
)
from test_demo_processes import commits, engine_sums, trainer_sums
from test_sharded_processes import fsdp2_pods_to_tp2_replica

from weightsync.crds import contract

pytest.importorskip("nixl", reason="the GDR transport needs NIXL (pip install 'weightsync[gdr]')")

VERSIONS = 3


def gdr_cluster(tmp_path: Path, clusters: list[Cluster], *, verify: str = "None") -> Cluster:
    c = Cluster(tmp_path, mode="GDR", bucket_mb=1, verify=verify)
    c.extra_env["WEIGHTSYNC_DEMO_HIDDEN"] = "600"  # fc2 is 1.4 MB: a version spans several 1 MB buckets
    clusters.append(c)
    return c


def assert_bit_exact(t: Pod, pods: list[Pod], version: int) -> None:
    want = trainer_sums(t, version)
    assert len(want) == 7
    for p in pods:
        served, got = engine_sums(p.demo_url)
        assert served == version
        assert got == want, f"{p.name} is not bit-exact with the trainer's version {version}"


def test_gdr_two_replicas_and_a_late_replica_bit_exact(tmp_path: Path, clusters: list[Cluster]) -> None:
    c = gdr_cluster(tmp_path, clusters)
    t, infs = c.start_separated(2, "--versions", str(VERSIONS), "--interval", "1.0")

    for p in infs:
        wait_for(lambda p=p: engine_version(p) == VERSIONS, 120, f"{p.name} serving version {VERSIONS}", c)
    assert_bit_exact(t, infs, VERSIONS)
    before = {p.name: commits(p.demo_url) for p in infs}
    for p in infs:
        seq = before[p.name]
        assert seq == sorted(set(seq)) and seq[-1] == VERSIONS, f"{p.name}: commits out of order: {seq}"

    # a third replica joins after the last version: the topology grows (new generation), it pulls v3
    late = c.join_late(2)
    wait_for(lambda: engine_version(late) == VERSIONS, 120, f"late replica serving version {VERSIONS}", c)
    assert_bit_exact(t, [*infs, late], VERSIONS)
    assert commits(late.demo_url) == [VERSIONS], "the late replica should load only the current version"
    for p in infs:  # the others were not disturbed: nothing re-fetched, nothing re-committed
        assert commits(p.demo_url) == before[p.name], f"{p.name} committed again after the late join"

    _, tm = get_text(f"{t.metrics_url}/metrics")
    assert (metric_value(tm, "weightsync_agent_transfer_bytes_total", 'direction="sent",mode="GDR"') or 0) > 0
    for p in (*infs, late):  # the agent counts a version (healthz, then metrics) after the engine's resume
        health = wait_for(lambda p=p: agent_served(p, VERSIONS), 15, f"{p.name}'s agent counts v{VERSIONS}", c)
        assert health["mode"] == "GDR", health
        _, im = get_text(f"{p.metrics_url}/metrics")
        assert (metric_value(im, "weightsync_agent_transfer_bytes_total", 'direction="received",mode="GDR"')
                or 0) > 0


def _received(p: Pod) -> tuple[float, float, float]:
    """(weight bytes received, bytes actually read, buckets received as deltas) from an inference agent."""
    _, m = get_text(f"{p.metrics_url}/metrics")
    full = metric_value(m, "weightsync_agent_transfer_bytes_total", 'direction="received",mode="GDR"') or 0.0
    wire = metric_value(m, "weightsync_agent_wire_bytes_total", 'mode="GDR"')
    assert wire is not None, f"{p.name}: no weightsync_agent_wire_bytes_total sample"
    return full, wire, metric_value(m, "weightsync_agent_delta_buckets_total") or 0.0


DELTA_VERSIONS = 4
SPARSE = 0.02  # the demo trainer changes 2% of every parameter's elements per version


def test_gdr_delta_sync_sends_changed_words_bit_exact_and_a_late_replica_gets_full_buckets(
    tmp_path: Path, clusters: list[Cluster]
) -> None:
    """spec.transfer.deltaSync end to end (the env the operator sets): after a full first version each
    replica reads only the changed words of a bucket and applies them to the previous version's bytes;
    the result is bit-exact with the trainer. A replica that joins later (new generation, new transports,
    no base) gets full buckets and is bit-exact too."""
    c = gdr_cluster(tmp_path, clusters)
    c.extra_env[contract.ENV_DELTA_SYNC] = "true"
    c.extra_env[contract.ENV_DELTA_MAX_CHANGED_FRACTION] = "0.25"
    t, infs = c.start_separated(2, "--versions", str(DELTA_VERSIONS), "--interval", "1.0", "--sparse-update", str(SPARSE))

    for p in infs:
        wait_for(lambda p=p: engine_version(p) == DELTA_VERSIONS, 120, f"{p.name} serving v{DELTA_VERSIONS}", c)
        # its byte counters are read below: the agent counts a version after the engine's commit and resume
        wait_for(lambda p=p: agent_served(p, DELTA_VERSIONS), 15, f"{p.name}'s agent counts v{DELTA_VERSIONS}", c)
    assert_bit_exact(t, infs, DELTA_VERSIONS)
    for p in infs:
        seq = commits(p.demo_url)
        assert seq == sorted(set(seq)) and seq[-1] == DELTA_VERSIONS, f"{p.name}: commits out of order: {seq}"
        assert len(seq) >= 2, f"{p.name} committed only {seq}: no version could be a delta"
        full, wire, deltas = _received(p)
        per_version = full / len(seq)
        # the first version is read in full; every later one is a delta of a few % (at most 20% here)
        assert deltas >= 1, f"{p.name}: delta sync was never used (full={full} wire={wire})"
        assert wire <= per_version * (1 + 0.2 * (len(seq) - 1)), f"{p.name}: read {wire} of {full} bytes"
        code, health = get_json(f"{p.metrics_url}/healthz")
        assert code == 200 and health["deltaSync"] is True and health["mode"] == "GDR", health
        assert "deltaSync requested but" not in c.log_text(p, "agent")
    before = {p.name: commits(p.demo_url) for p in infs}

    late = c.join_late(2)
    wait_for(lambda: engine_version(late) == DELTA_VERSIONS, 120, f"late replica serving v{DELTA_VERSIONS}", c)
    wait_for(lambda: agent_served(late, DELTA_VERSIONS), 15, f"the late agent counts v{DELTA_VERSIONS}", c)
    assert_bit_exact(t, [*infs, late], DELTA_VERSIONS)
    assert commits(late.demo_url) == [DELTA_VERSIONS]
    full, wire, deltas = _received(late)
    assert full > 0 and wire == full and deltas == 0, f"late replica: full={full} wire={wire} deltas={deltas}"
    for p in infs:
        assert commits(p.demo_url) == before[p.name], f"{p.name} committed again after the late join"


def test_gdr_with_checksum_verification_bit_exact(tmp_path: Path, clusters: list[Cluster]) -> None:
    c = gdr_cluster(tmp_path, clusters, verify="Checksum")
    t, infs = c.start_separated(2, "--versions", str(VERSIONS), "--interval", "1.0")

    for p in infs:
        wait_for(lambda p=p: engine_version(p) == VERSIONS, 120, f"{p.name} serving version {VERSIONS}", c)
    assert_bit_exact(t, infs, VERSIONS)
    for p in infs:
        code, health = get_json(f"{p.metrics_url}/healthz")
        assert code == 200 and health["verify"] is True and health["mode"] == "GDR", health
        _, im = get_text(f"{p.metrics_url}/metrics")
        assert (metric_value(im, "weightsync_agent_verified_bytes_total") or 0) > 0  # checksums were checked
        _, body = get_json(f"{p.demo_url}/events")
        assert not [v for e, v in body["events"] if e == "abort"], f"{p.name} aborted a load: {body['events']}"


def test_gdr_recovers_after_a_failed_version(tmp_path: Path, clusters: list[Cluster]) -> None:
    """A version that fails mid-transfer (the engine rejects its first load of v1) leaves GDR frames
    unconsumed and the control links aborted; the retry must run on fresh links and transports (new
    epoch) and every later version must be bit-exact."""
    c = gdr_cluster(tmp_path, clusters)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    c.start_agent(t)
    c.start_agent(i)
    c.start_engine(i, "--fail-versions", "1")
    # the first load must be v1: the engine is connected before the trainer publishes (under load it could
    # start after v2 and the agent would load the newest version first)
    c.wait_linked(i)
    c.start_trainer(t, "--versions", str(VERSIONS), "--interval", "1.5")

    wait_for(lambda: engine_version(i) == VERSIONS, 120, f"engine at v{VERSIONS} after a failed load", c)
    _, body = get_json(f"{i.demo_url}/events")
    events = [tuple(e) for e in body["events"]]
    assert ("abort", 1) in events, events
    first_commit = next(k for k, e in enumerate(events) if e[0] == "commit")
    assert events.index(("abort", 1)) < first_commit, f"v1 should fail before anything commits: {events}"
    seq = commits(i.demo_url)
    assert seq == sorted(set(seq)) and seq[-1] == VERSIONS, f"commits out of order: {seq}"
    assert_bit_exact(t, [i], VERSIONS)
    _, im = get_text(f"{i.metrics_url}/metrics")
    assert (metric_value(im, "weightsync_agent_versions_total", 'result="failed"') or 0) >= 1


def test_gdr_fsdp2_trainer_pods_to_tp2_replica(tmp_path: Path, clusters: list[Cluster]) -> None:
    """Two trainer pods (FSDP Shard(0)) -> one inference pod with TP ranks 0 and 1: every destination rank
    reads from both source ranks, one GDR transport per source behind the agent's routing transport."""
    c = Cluster(tmp_path, mode="GDR", bucket_mb=1, verify="Checksum")
    clusters.append(c)
    fsdp2_pods_to_tp2_replica(c, VERSIONS)


def test_gdr_inference_agent_killed_mid_load_recovers(tmp_path: Path, clusters: list[Cluster]) -> None:
    """The inference agent dies (SIGKILL) while reading a version: its NIXL agent and links vanish under the
    trainer's GDR sender. The engine must drop the partial version, the trainer agent must keep serving,
    and the restarted agent (new session, new epoch, new transports) must catch up bit-exactly."""
    t, i, killed = kill_inference_agent_mid_load(gdr_cluster(tmp_path, clusters))
    assert_bit_exact(t, [i], 4)
    _, body = get_json(f"{i.demo_url}/events")
    events = [tuple(e) for e in body["events"]]
    k = events.index(("abort", killed))
    assert ("commit", killed) not in events[:k], events
