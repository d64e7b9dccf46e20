"""spec.transfer.fanOut Relay through real agent processes (agent/transfer/relay.py): the trainer agent sends each
version once, the replicas forward it along a chain, and every replica still serves the trainer's bytes.

Each pod is its own process on its own loopback address (podprocs), the chain's hops are gloo groups like
the trainer's, and the digest leaves every replica checks are the trainer's, forwarded with each bucket."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from podprocs import Cluster, agent_served, engine_version, get_json, get_text, metric_value, wait_for
from test_demo_processes import engine_sums, trainer_sums

from weightsync.crds import contract

REPLICAS = 3


def _bytes(pod_metrics: str, direction: str) -> float:
    return metric_value(pod_metrics, "weightsync_agent_transfer_bytes_total", f'direction="{direction}"') or 0.0


@pytest.mark.parametrize("mode", ["NCCL", "GDR"])
def test_relay_chain_sends_each_version_once_and_every_replica_is_bit_exact(tmp_path: Path, clusters: list[Cluster],
                                                                           mode: str) -> None:
    """NCCL: each hop is a gloo group; GDR: each replica reads the buckets out of the receive slots of the one
    before it (NIXL READ), as the first reads the trainer's staging."""
    if mode == "GDR":
        pytest.importorskip("nixl", reason="GDR needs NIXL (the agent extra installs it)")
    c = Cluster(tmp_path, mode=mode, bucket_mb=1, verify="Checksum")
    c.extra_env["WEIGHTSYNC_DEMO_HIDDEN"] = "640"  # several 1 MiB buckets per version
    c.extra_env[contract.ENV_FAN_OUT] = "Relay"
    c.extra_env["WEIGHTSYNC_FANOUT_GATHER_SECONDS"] = "1.0"  # the replicas' fetches start within a second here
    clusters.append(c)
    # versions far enough apart that every replica fetches each one (a replica that skips one is not chained)
    t, infs = c.start_separated(REPLICAS, "--versions", "3", "--interval", "4", replicas_ready=True)

    for p in infs:
        wait_for(lambda p=p: engine_version(p) == 3, 120, f"{p.name} serving version 3", c)
    want = trainer_sums(t, 3)
    for p in infs:
        version, got = engine_sums(p.demo_url)
        assert version == 3 and got == want, f"{p.name} is not bit-exact with the trainer's version 3"

    _, tm = get_text(f"{t.metrics_url}/metrics")
    ims = [get_text(f"{p.metrics_url}/metrics")[1] for p in infs]
    sent = _bytes(tm, "sent")
    received = [_bytes(m, "received") for m in ims]
    relayed = [_bytes(m, "relayed") for m in ims]
    assert all(r > 0 for r in received), received
    # every replica received every version it loaded; the trainer sent about one replica's worth, not three
    assert sent < 0.5 * sum(received), (sent, received)
    # the chain runs by replica index: 0 -> 1 -> 2; the last one forwards nothing
    assert relayed[0] > 0 and relayed[1] > 0 and relayed[2] == 0, relayed
    assert (metric_value(tm, "weightsync_agent_versions_total", 'result="relayed"') or 0) >= 2
    for m in ims:
        assert (metric_value(m, "weightsync_agent_verified_bytes_total") or 0) > 0  # checksums forwarded, checked
    assert "relay.done" in c.log_text(infs[0], "agent")
    wait_for(lambda: agent_served(infs[2], 3), 15, f"{infs[2].name}'s agent counts version 3 served", c)


def test_a_replica_fetching_alone_is_sent_to_at_once(tmp_path: Path, clusters: list[Cluster]) -> None:
    """The trainer agent waits for other replicas to chain only when they asked for the version too (a Rolling
    wave of one replica, or the others stopped, costs nothing): with a 20 s gather window and replica 1's agent
    stopped, replica 0 loads each version in well under 20 s (a first fetch sets up its group: seconds on a loaded
    machine), and replica 1 catches up alone once resumed."""
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    c.extra_env[contract.ENV_FAN_OUT] = "Relay"
    c.extra_env["WEIGHTSYNC_FANOUT_GATHER_SECONDS"] = "20"
    clusters.append(c)
    t, infs = c.start_separated(2, "--versions", "2", "--interval", "2")
    os.killpg(infs[1].procs["agent"].pid, signal.SIGSTOP)
    wait_for(lambda: engine_version(infs[0]) == 2, 90, f"{infs[0].name} serving version 2", c)
    took = [float(x) for x in re.findall(r"version committed version=\d+ .*? seconds=([\d.]+)",
                                         c.log_text(infs[0], "agent"))]
    assert took and max(took) < 10, took
    os.killpg(infs[1].procs["agent"].pid, signal.SIGCONT)
    wait_for(lambda: engine_version(infs[1]) == 2, 90, f"{infs[1].name} serving version 2 after it resumed", c)
    assert engine_sums(infs[1].demo_url)[1] == trainer_sums(t, 2)
    assert "serve.fan_out" not in c.log_text(t, "agent")


def test_a_relay_killed_mid_version_fails_its_downstream_which_then_fetches_directly(
        tmp_path: Path, clusters: list[Cluster]) -> None:
    """SIGKILL the first replica's agent while it relays a version to the second: the second never commits
    a partial version (its engine aborts it), its next attempt asks the trainer directly, and it serves the
    trainer's bytes; the first, restarted, catches up too."""
    c = Cluster(tmp_path, mode="NCCL", bucket_mb=1)
    c.extra_env["WEIGHTSYNC_DEMO_HIDDEN"] = "2048"  # fc2 is 16 MiB: a version spans many buckets
    c.extra_env[contract.ENV_FAN_OUT] = "Relay"
    clusters.append(c)
    t, infs = c.start_separated(2, "--versions", "4", "--interval", "3")
    down = infs[1]

    def mid_load() -> int | None:
        _, body = get_json(f"{down.demo_url}/events", timeout=2)
        ev = body["events"]
        return ev[-1][1] if ev and ev[-1][0] == "begin" and ev[-1][1] >= 2 else None

    cut = int(wait_for(mid_load, 90, "the downstream replica loading a relayed version", c, interval=0.01))
    c.kill(infs[0], "agent")
    wait_for(lambda: ["abort", cut] in get_json(f"{down.demo_url}/events")[1]["events"]
             or engine_version(down) == cut, 60, f"v{cut} aborted (or completed) on {down.name}", c)
    wait_for(lambda: engine_version(down) == 4, 120, f"{down.name} serving version 4", c)
    assert engine_sums(down.demo_url)[1] == trainer_sums(t, 4)
    events = get_json(f"{down.demo_url}/events")[1]["events"]
    commits = [v for e, v in events if e == "commit"]
    assert commits == sorted(set(commits)), f"a version committed twice or out of order: {commits}"
    c.start_agent(infs[0])
    wait_for(lambda: engine_version(infs[0]) == 4, 120, f"{infs[0].name} restarted and serving version 4", c)
    assert engine_sums(infs[0].demo_url)[1] == trainer_sums(t, 4)
