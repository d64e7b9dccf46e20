"""Real agent processes + demo trainer/engine processes on loopback IPs, no Kubernetes.

What is checked, bit for bit: the sha256 of every weight the demo engine serves equals the trainer's
sha256 of the same version (both computed from the raw bytes).
"""

from __future__ import annotations

from pathlib import Path

from podprocs import (
    Cluster,
    Pod,
    agent_served,
    engine_serving,
    engine_version,
    get_json,
    get_text,
    kill_inference_agent_mid_load,
    metric_value,
    wait_for,
)

from weightsync.crds import contract


def trainer_sums(pod: Pod, version: int) -> dict[str, str]:
    code, body = get_json(f"{pod.demo_url}/checksums?version={version}")
    assert code == 200, body
    return body["checksums"]


def engine_sums(url: str) -> tuple[int | None, dict[str, str]]:
    code, body = get_json(f"{url}/checksums")
    assert code == 200, body
    return body["version"], body["checksums"]


def commits(url: str) -> list[int]:
    _, body = get_json(f"{url}/events")
    return [v for e, v in body["events"] if e == "commit"]


def test_separated_gloo_two_replicas_bit_exact(tmp_path: Path, clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1, verify="Checksum")
    c.extra_env["WEIGHTSYNC_DEMO_HIDDEN"] = "96"
    clusters.append(c)
    t, infs = c.start_separated(2, "--versions", "5", "--interval", "0.3")

    for p in infs:
        wait_for(lambda p=p: engine_version(p) == 5, 90, f"{p.name} serving version 5", c)
    want = trainer_sums(t, 5)
    assert len(want) == 7
    for p in infs:
        version, got = engine_sums(p.demo_url)
        assert version == 5
        assert got == want, f"{p.name} is not bit-exact with the trainer's version 5"
        seq = commits(p.demo_url)
        assert seq == sorted(set(seq)) and seq[-1] == 5, f"commits out of order: {seq}"

    # the agent counts v5 served (healthz, then its metrics) after the engine's commit and resume
    health = wait_for(lambda: agent_served(infs[0], 5), 15, f"{infs[0].name}'s agent counts version 5 served", c)
    assert health["ok"] and health["role"] == "inference"
    assert health["verify"] is True
    code, health = get_json(f"{t.metrics_url}/healthz")
    assert code == 200 and health["published"] == 5
    _, tm = get_text(f"{t.metrics_url}/metrics")
    im = wait_for(lambda: metric_value(m := get_text(f"{infs[0].metrics_url}/metrics")[1],
                                       "weightsync_agent_served_version") == 5 and m, 15, "served_version gauge 5", c)
    assert metric_value(tm, "weightsync_agent_published_version") == 5
    assert (metric_value(tm, "weightsync_agent_transfer_bytes_total", 'direction="sent",mode="NCCL"') or 0) > 0
    assert metric_value(im, "weightsync_agent_served_version") == 5
    assert (metric_value(im, "weightsync_agent_verified_bytes_total") or 0) > 0  # verify: Checksum ran
    assert (metric_value(im, "weightsync_agent_transfer_bytes_total", 'direction="received"') or 0) > 0
    assert (metric_value(im, "weightsync_agent_sync_seconds_count", 'mode="NCCL"') or 0) >= 1


def test_colocated_ipc_shared_memory_bit_exact(tmp_path: Path, clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="IPC", placement="Colocated", bucket_mb=1)
    clusters.append(c)
    p = c.add_pod("demo-colocated-0", contract.ROLE_COLOCATED)
    c.write_topology()
    c.start_agent(p)
    c.start_engine(p, "--port", "8001")
    c.start_trainer(p, "--versions", "5", "--interval", "0.3")
    engine_url = f"http://{p.ip}:8001"
    wait_for(lambda: get_json(f"{engine_url}/version")[1].get("version") == 5, 90, "colocated engine at v5", c)
    version, got = engine_sums(engine_url)
    assert version == 5 and got == trainer_sums(p, 5)
    _, m = get_text(f"{p.metrics_url}/metrics")
    assert (metric_value(m, "weightsync_agent_transfer_bytes_total", 'direction="received",mode="IPC"') or 0) > 0


def test_late_joiner_and_agent_restart_catch_up(tmp_path: Path, clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    c.start_agent(t)
    c.start_trainer(t, "--versions", "6", "--interval", "1.0")
    wait_for(lambda: get_json(f"{t.demo_url}/version")[1].get("version", 0) >= 2, 60, "trainer at v2", c)
    # late joiner: the inference pod starts after versions were published and pulls the current one
    published_before_join = get_json(f"{t.demo_url}/version")[1]["version"]
    c.start_agent(i)
    c.start_engine(i)
    first = wait_for(lambda: v if (v := engine_version(i) or 0) >= 2 else None, 60,
                     "late joiner loaded a version", c)
    # the inference agent dies (SIGKILL) and restarts: the engine keeps serving and reconnects
    c.kill(i, "agent")
    code, body = get_json(f"{i.demo_url}/predict?x=0.5")
    assert code == 200 and body["version"] is not None
    c.start_agent(i)
    wait_for(lambda: engine_version(i) == 6, 90, "restarted agent caught up to v6", c)
    version, got = engine_sums(i.demo_url)
    assert version == 6 and got == trainer_sums(t, 6)
    seq = commits(i.demo_url)
    # the late joiner's first load is a version current when it joined, never a replay from v1; it is not
    # always the one the wait saw, since the next version can commit between two polls (CI saw [3, 4, ...]
    # with the wait reading 4); versions only move forward
    assert published_before_join <= seq[0] <= first and first in seq, (published_before_join, first, seq)
    assert seq == sorted(set(seq)), seq
    # the engine restarts with its initial weights: the agent loads the current version into it again
    c.kill(i, "engine")
    c.start_engine(i)
    wait_for(lambda: engine_version(i) == 6, 60, "restarted engine reloaded v6", c)
    version, got = engine_sums(i.demo_url)
    assert version == 6 and got == trainer_sums(t, 6)


def test_failed_load_is_aborted_and_engine_always_resumed(tmp_path: Path, clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    t = c.add_pod("demo-trainer-0", contract.ROLE_TRAINER)
    i = c.add_pod("demo-inference-0-0", contract.ROLE_INFERENCE)
    c.write_topology()
    c.start_agent(t)
    c.start_agent(i)
    c.start_engine(i, "--fail-versions", "1,2")
    # the first load must be v1: the engine is connected before the trainer publishes (under load it could
    # start after v2 and the agent would load the newest version first)
    c.wait_linked(i)
    c.start_trainer(t, "--versions", "3", "--interval", "1.5")
    wait_for(lambda: engine_serving(i, 3), 90, "engine at v3 after failed loads, resumed", c)
    _, body = get_json(f"{i.demo_url}/events")
    events = [tuple(e) for e in body["events"]]
    aborted = [v for e, v in events if e == "abort"]
    assert aborted[:1] == [1], events  # the first load (v1) failed in the engine and was aborted
    # every pause is followed by a resume before anything else pauses, and every begin sits inside one
    paused = False
    for e, v in events:
        if e == "pause":
            assert not paused, events
            paused = True
        elif e == "resume":
            assert paused, events
            paused = False
        elif e in ("begin", "commit", "abort"):
            assert paused, f"{e} of v{v} outside a pause: {events}"
    assert not paused, "the engine was left paused"
    version, got = engine_sums(i.demo_url)
    assert version == 3 and got == trainer_sums(t, 3)
    _, m = get_text(f"{i.metrics_url}/metrics")
    assert (metric_value(m, "weightsync_agent_versions_total", 'result="failed"') or 0) >= 1


def test_inference_agent_killed_mid_load_never_serves_the_partial_version(tmp_path: Path,
                                                                          clusters: list[Cluster]) -> None:
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    clusters.append(c)
    t, i, killed = kill_inference_agent_mid_load(c)
    version, got = engine_sums(i.demo_url)
    assert version == 4 and got == trainer_sums(t, 4)
    wait_for(lambda: engine_serving(i, 4), 15, "the engine resumed (not left paused by the dead agent)", c)
    _, body = get_json(f"{i.demo_url}/events")
    events = [tuple(e) for e in body["events"]]
    k = events.index(("abort", killed))
    assert ("commit", killed) not in events[:k], events
