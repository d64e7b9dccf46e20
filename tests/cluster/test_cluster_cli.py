"""`make dev-up` / `dev-status` / `dev-down` through the CLI: a detached supervisor owns the environment;
down leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.e2e.procs import listening_ports, pid_alive

pytestmark = pytest.mark.cluster


def cli(dev_dir: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WEIGHTSYNC_DEV_DIR": str(dev_dir)}
    return subprocess.run([sys.executable, "-m", "weightsync.e2e.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_up_status_down(tmp_path: Path) -> None:
    up = cli(tmp_path, "up", "--nodes", "2", "--no-runtime")
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        assert f"export KUBECONFIG={tmp_path / 'kubeconfig'}" in up.stdout
        state = json.loads((tmp_path / "state.json").read_text())
        assert state["status"] == "ready" and state["nodes"] == ["gpu-node-0", "gpu-node-1"]
        pids = [state["supervisor_pid"], *state["pids"].values()]
        assert all(pid_alive(p) for p in pids)

        again = cli(tmp_path, "up", "--no-runtime")
        assert again.returncode == 0 and "already running" in again.stdout

        status = cli(tmp_path, "status")
        assert status.returncode == 0, status.stdout
        assert "/readyz: ok" in status.stdout and "gpu-node-1" in status.stdout
    finally:
        down = cli(tmp_path, "down")
    assert down.returncode == 0, down.stderr
    assert not [p for p in pids if pid_alive(p)]
    assert not set(state["ports"].values()) & listening_ports()
    assert not (tmp_path / "state.json").exists()
    assert cli(tmp_path, "status").returncode == 1
    assert "not running" in cli(tmp_path, "down").stdout
