"""F5 of the hostile-input issue: a TrainerSession outlives its agent. Before, an agent restart crashed the
trainer with BrokenPipe on its next publish. Now a call reconnects with back-off and is done again from the
start (the new agent has none of the old one's staging), and an agent that stays away ends in a clear
AgentUnavailable after `reconnect_timeout`, not a crash inside the training step. The agent side is the
real local socket server with a real StagedVersions in shared memory (staging_agent.serve_staging)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from staging_agent import serve_staging

from weightsync.agent.client import AgentUnavailable, TrainerSession
from weightsync.agent.layout.shards import checksums
from weightsync.agent.staging import segments
from weightsync.agent.staging.versions import StagedVersions
from weightsync.agent.wire.local import LocalServer

HERE = Path(__file__).resolve().parent
AGENT = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from staging_agent import serve_staging
from weightsync.agent.staging.versions import StagedVersions
serve_staging(__import__("pathlib").Path(sys.argv[2]), StagedVersions([0], sys.argv[3]))
print("ready", flush=True)
threading.Event().wait()
"""


def start_agent_process(sock: Path, prefix: str, shm: Path) -> subprocess.Popen[str]:
    """A stand-in trainer agent in its own process (so it can die like a container: SIGKILL)."""
    p = subprocess.Popen([sys.executable, "-c", AGENT, str(HERE), str(sock), prefix], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, segments.SHM_DIR_ENV: str(shm)})
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _weights(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def test_publish_survives_an_agent_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    sock = tmp_path / "agent.sock"
    agent = start_agent_process(sock, "wsold", tmp_path)
    restarted: list[tuple[LocalServer, StagedVersions]] = []
    try:
        with TrainerSession(sock, rank=0, reconnect_timeout=30) as s:
            s.publish(_weights(1), version=1)
            agent.kill()  # the agent container dies (SIGKILL): its end of the socket is gone
            agent.wait()

            def restart() -> None:
                time.sleep(1.0)
                store = StagedVersions([0], "wsnew")
                restarted.append((serve_staging(sock, store), store))

            t0 = time.monotonic()  # before the restart thread runs: its 1 s sleep is all inside the measured span
            threading.Thread(target=restart, daemon=True).start()
            res = s.publish(_weights(2), version=2)  # was: BrokenPipeError
            assert res.version == 2 and time.monotonic() - t0 >= 0.9
            assert s.reconnects >= 1
        _, store = restarted[0]
        got = store.get(2)
        assert got is not None, "the publish after the restart was not staged by the new agent"
        assert checksums(got.ranks[0].tensors().items()) == checksums(_weights(2).items())
    finally:
        agent.kill()
        for srv, st in restarted:
            srv.close()
            st.close()


def test_agent_that_stays_away_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    sock = tmp_path / "agent.sock"
    agent = start_agent_process(sock, "wsgone", tmp_path)
    with TrainerSession(sock, rank=0, reconnect_timeout=1.5) as s:
        s.publish(_weights(1), version=1)
        agent.kill()
        agent.wait()
        t0 = time.monotonic()
        with pytest.raises(AgentUnavailable, match=r"publish\(2\).*did not come back within 1.5s"):
            s.publish(_weights(2), version=2)
        assert 1.0 <= time.monotonic() - t0 < 10


def test_an_agent_answer_is_never_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(segments.SHM_DIR_ENV, str(tmp_path))
    store = StagedVersions([0], "wsanswer")
    server = serve_staging(tmp_path / "agent.sock", store)
    try:
        with TrainerSession(tmp_path / "agent.sock", rank=0, reconnect_timeout=30) as s:
            s.publish(_weights(1), version=1)
            t0 = time.monotonic()
            with pytest.raises(Exception, match="must increase"):
                s.publish(_weights(1), version=1)
            assert time.monotonic() - t0 < 5 and s.reconnects == 0
    finally:
        server.close()
        store.close()
