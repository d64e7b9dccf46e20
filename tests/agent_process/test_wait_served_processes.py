"""TrainerSession.wait_served with real agent processes: one trainer agent, two inference replicas (agent +
demo engine each) on loopback IPs; the test process is the trainer app and publishes the demo model itself.

wait_served returns once every replica committed the version (the engines already serve it then), and
times out with a message that names the version, the timeout and what each lagging replica serves.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from podprocs import Cluster, demo_replicas, engine_version, wait_for

from weightsync.agent.client import ServedTimeout, TrainerSession
from weightsync.agent.demo.model import DemoModel
from weightsync.crds import contract

HIDDEN = 32


def test_wait_served_returns_once_loaded_and_times_out_clearly(tmp_path: Path, clusters: list[Cluster]) -> None:
    c, trainer, infs = demo_replicas(tmp_path, clusters, HIDDEN)
    model = DemoModel(HIDDEN)

    with TrainerSession(tmp_path / trainer.name / "sock" / contract.AGENT_SOCKET_NAME, rank=0, timeout=60) as s:
        assert s.served().replicas == {0: None, 1: None}
        with pytest.raises(ServedTimeout) as err:
            s.wait_served(1, timeout=1)
        msg = str(err.value)
        assert msg.startswith("version 1 is not served by every inference replica after 1s: 2 of 2 replicas"), msg
        assert "replica 0 serves nothing yet (pod demo-inference-0-0: none)" in msg, msg

        s.publish(model, version=1)
        t0 = time.monotonic()
        state = s.wait_served(1, timeout=90)
        assert state.replicas == {0: 1, 1: 1} and state.version == 1, state
        assert [engine_version(p) for p in infs] == [1, 1], "wait_served returned before the engines served v1"
        assert time.monotonic() - t0 < 60

        # replica 1's engine goes away: version 2 reaches replica 0 only, and the wait says so
        c.kill(infs[1], "engine")
        s.publish(model, version=2)
        wait_for(lambda: engine_version(infs[0]) == 2, 60, "replica 0 serving version 2", c)
        with pytest.raises(ServedTimeout) as err:
            s.wait_served(2, timeout=3)
        assert err.value.state.replicas == {0: 2, 1: 1}
        msg = str(err.value)
        assert "version 2" in msg and "after 3s" in msg and "1 of 2 replicas are behind" in msg, msg
        assert "replica 1 serves 1 (pod demo-inference-1-0: 1)" in msg and "replica 0" not in msg, msg
        assert s.wait_served(1, timeout=1).replicas == {0: 2, 1: 1}, "bounded staleness: v1 is served everywhere"

        # a new engine process (it serves nothing) connects; its agent loads v2 and wait_served returns
        c.start_engine(infs[1])
        assert s.wait_served(2, timeout=90).replicas == {0: 2, 1: 2}
        assert engine_version(infs[1]) == 2
