"""The trainer agent hashes a staged version once for the content digest, whatever the number of inference
replicas: real agent processes, one trainer pod and two inference replicas (NCCL over gloo); every receiver
still hashes what landed and checks it against the leaves the first transfer computed."""

from __future__ import annotations

from pathlib import Path

import pytest
from podprocs import Cluster, demo_replicas, engine_version, get_text, metric_value, wait_for

from weightsync.agent.client import TrainerSession
from weightsync.agent.demo.model import DemoModel
from weightsync.crds import contract

HIDDEN = 64


def _metric(url: str, name: str, labels: str) -> float:
    code, text = get_text(f"{url}/metrics")
    assert code == 200
    return metric_value(text, name, labels) or 0.0


@pytest.mark.parametrize("staging", ["version", "ring"])
def test_the_trainer_agent_hashes_a_version_once_for_all_replicas(tmp_path: Path, clusters: list[Cluster],
                                                                 staging: str) -> None:
    c, trainer, infs = demo_replicas(tmp_path, clusters, HIDDEN, WEIGHTSYNC_STAGING=staging)
    model = DemoModel(HIDDEN)
    with TrainerSession(tmp_path / trainer.name / "sock" / contract.AGENT_SOCKET_NAME, rank=0, timeout=60) as s:
        for v in (1, 2, 3):
            s.publish(model, version=v)
            if staging == "version":  # (ring: the CPU publish returns once every replica serves it)
                assert s.wait_served(v, timeout=90).replicas == {0: v, 1: v}
            wait_for(lambda v=v: [engine_version(p) for p in infs] == [v, v], 60, f"both replicas serving v{v}", c)
    name = "weightsync_agent_digest_bytes_total"
    sent = _metric(trainer.metrics_url, "weightsync_agent_transfer_bytes_total", 'direction="sent"')
    hashed = _metric(trainer.metrics_url, name, 'side="sent",source="hashed"')
    reused = _metric(trainer.metrics_url, name, 'side="sent",source="reused"')
    assert sent > 0
    # each version's bytes were hashed once, and sent with those leaves to the other replica (the digest covers
    # the tensors' bytes, the transfer also the alignment between them)
    assert hashed == reused and hashed == pytest.approx(sent / 2, rel=0.05), (sent, hashed, reused)
    for p in infs:  # every receiver hashed everything it got
        got = _metric(p.metrics_url, "weightsync_agent_transfer_bytes_total", 'direction="received"')
        assert _metric(p.metrics_url, name, 'side="received",source="hashed"') == pytest.approx(got, rel=0.05) and got > 0
